"""ferry as a NIXL backend, driven through NIXL's own Python API.

Run by .ci/run (nixl/run_tests.sh): a throwaway venv with the `nixl` wheel
from PyPI, NIXL_PLUGIN_DIR holding libplugin_FERRY.so beside links to the
wheel's own plugins. Two agents in two processes: this one initiates, a
child (`_target`) owns the far buffer and answers commands over a pipe.
Every wait has a deadline. FERRY_NIXL_MEM=VRAM runs it all on GPU memory
(CuPy arrays on GPU 0 in both processes) instead of host memory.
"""

import multiprocessing as mp
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from nixl._api import nixl_agent, nixl_agent_config

BACKEND = os.environ.get("FERRY_NIXL_BACKEND", "FERRY")
MEM = os.environ.get("FERRY_NIXL_MEM", "DRAM")
VRAM = MEM == "VRAM"
DEV = 0
if VRAM:
    import cupy as xp
else:
    xp = np
TARGET_BYTES = 8 << 20
DEADLINE_S = 30.0


def make_agent(name):
    return nixl_agent(name, nixl_agent_config(backends=[BACKEND]))


def register(ag, arr):
    descs = ag.get_reg_descs([(addr(arr), arr.nbytes, DEV, "")], MEM)
    ag.register_memory(descs)
    return descs


def pattern(n, seed):
    """`n` bytes of seed `seed`, on the host."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def new_buf(n, seed):
    """`n` bytes of seed `seed` in the memory under test."""
    return xp.asarray(pattern(n, seed))


def addr(a):
    return a.data.ptr if VRAM else a.ctypes.data


def host(a):
    """A host copy (or the array itself, for host memory)."""
    return xp.asnumpy(a) if VRAM else a


def wait_done(ag, h, deadline_s=DEADLINE_S):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        st = ag.check_xfer_state(h)
        if st != "PROC":
            return st
    raise AssertionError("the transfer did not end in time")


def _target(pipe, name, nbytes):
    """The far agent: a buffer of `nbytes` (pattern seed 1) and commands."""
    ag = make_agent(name)
    buf = new_buf(nbytes, 1)
    register(ag, buf)
    pipe.send((ag.get_agent_metadata(), addr(buf)))
    seen = []

    def await_note(msg):
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            for agent, msgs in ag.get_new_notifs().items():
                for m in msgs:
                    seen.append((agent, m))
            for i, (agent, m) in enumerate(seen):
                if m == msg:
                    del seen[i]
                    return agent
        return None

    while True:
        cmd, *args = pipe.recv()
        if cmd == "meta":
            pipe.send(ag.add_remote_agent(args[0]))
        elif cmd == "get":
            off, n = args
            pipe.send(host(buf[off : off + n]).tobytes())
        elif cmd == "set":
            off, data = args
            buf[off : off + len(data)] = xp.asarray(np.frombuffer(data, dtype=np.uint8))
            pipe.send(True)
        elif cmd == "await_note":
            # Snapshot the range the moment the note arrives: it must
            # already hold the WRITE's bytes.
            msg, off, n = args
            who = await_note(msg)
            pipe.send((who, host(buf[off : off + n]).tobytes()))
        elif cmd == "await_note_clobber":
            # vLLM's prefill side: the note says the READ is done, so the
            # blocks are freed (overwritten) at once.
            msg, ranges = args
            who = await_note(msg)
            for off, n in ranges:
                buf[off : off + n] = 0xEE
            pipe.send(who)
        elif cmd == "notifs":
            want, deadline = args
            end = time.monotonic() + deadline
            while len(seen) < want and time.monotonic() < end:
                for agent, msgs in ag.get_new_notifs().items():
                    seen.extend((agent, m) for m in msgs)
            out, seen[:] = list(seen), []
            pipe.send(out)
        elif cmd == "notify":
            ag.send_notif(args[0], args[1])
            pipe.send(True)
        elif cmd == "drain_until_quiet":
            # Reads until nothing came for `quiet` seconds: the lengths
            # and first bytes of what came, in order.
            (quiet,) = args
            got, last = [], time.monotonic()
            while time.monotonic() - last < quiet:
                for agent, msgs in ag.get_new_notifs().items():
                    for m in msgs:
                        got.append((agent, len(m), bytes(m[:8]), bytes(m[-8:])))
                        last = time.monotonic()
            pipe.send(got)
        elif cmd == "exit":
            pipe.send(True)
            return


class Peer:
    """This process's agent and a target process."""

    def __init__(self, name, target="target", nbytes=TARGET_BYTES, load_target=True):
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target, args=(child, target, nbytes), daemon=True)
        self.proc.start()
        self.target = target
        self.ag = make_agent(name)
        self.tmeta, self.taddr = self.call_raw()
        if load_target:
            assert self.ag.add_remote_agent(self.tmeta) == target.encode()
        assert self.call("meta", self.ag.get_agent_metadata()) == name.encode()

    def call_raw(self):
        assert self.pipe.poll(DEADLINE_S), "the target did not answer in time"
        return self.pipe.recv()

    def call(self, *cmd):
        self.pipe.send(cmd)
        return self.call_raw()

    def remote(self, off, n):
        return self.ag.get_xfer_descs([(self.taddr + off, n, DEV)], MEM)

    def close(self):
        if self.proc.is_alive():
            self.call("exit")
        self.proc.join(10)


@pytest.fixture(scope="module")
def peer():
    p = Peer("initiator")
    yield p
    p.close()


@pytest.fixture
def local(peer):
    """Makes registered local buffers (on `ag`, the shared peer's agent by
    default), deregistered after the test."""
    held = []

    def make(nbytes, seed=7, ag=None):
        ag = ag or peer.ag
        arr = new_buf(nbytes, seed)
        held.append((ag, register(ag, arr), arr))
        return arr

    yield make
    for ag, descs, _ in held:
        ag.deregister_memory(descs)


def xfer(peer, op, arr, loff, roff, n, note=b""):
    l = peer.ag.get_xfer_descs([(addr(arr) + loff, n, DEV)], MEM)
    h = peer.ag.initialize_xfer(op, l, peer.remote(roff, n), peer.target, note)
    assert peer.ag.transfer(h) in ("PROC", "DONE")
    assert wait_done(peer.ag, h) == "DONE"
    peer.ag.release_xfer_handle(h)


@pytest.mark.parametrize(
    "loff,roff,n", [(0, 0, 1), (3, 5, 4097), (1, 12345, 1 << 20), (4095, 7, (3 << 20) + 11)]
)
def test_write_and_read_byte_exact(peer, local, loff, roff, n):
    src = local(loff + n, seed=n)
    xfer(peer, "WRITE", src, loff, roff, n)
    src = host(src)
    assert peer.call("get", roff, n) == src[loff : loff + n].tobytes()
    dst_mem = local(loff + n + 64, seed=n + 1)
    before = host(dst_mem).copy()
    xfer(peer, "READ", dst_mem, loff, roff, n)
    dst = host(dst_mem)
    assert dst[loff : loff + n].tobytes() == src[loff : loff + n].tobytes()
    # Nothing outside the range moved.
    assert (dst[:loff] == before[:loff]).all() and (dst[loff + n :] == before[loff + n :]).all()


def test_write_notification_arrives_after_its_data(peer, local):
    n = 2 << 20
    src = local(n, seed=21)
    l = peer.ag.get_xfer_descs([(addr(src), n, DEV)], MEM)
    h = peer.ag.initialize_xfer("WRITE", l, peer.remote(0, n), peer.target, b"w-note")
    peer.pipe.send(("await_note", b"w-note", 0, n))
    peer.ag.transfer(h)
    # No check_xfer call before the note must arrive: ferry sends it itself.
    who, seen = peer.call_raw()
    assert who == "initiator"
    assert seen == host(src).tobytes()
    assert wait_done(peer.ag, h) == "DONE"
    peer.ag.release_xfer_handle(h)


def test_read_notification_frees_blocks_safely(peer, local):
    n = 1 << 20
    orig = peer.call("get", 4 << 20, n)
    dst = local(n, seed=22)
    l = peer.ag.get_xfer_descs([(addr(dst), n, DEV)], MEM)
    h = peer.ag.initialize_xfer("READ", l, peer.remote(4 << 20, n), peer.target, b"r-note")
    peer.pipe.send(("await_note_clobber", b"r-note", [(4 << 20, n)]))
    peer.ag.transfer(h)
    assert peer.call_raw() == "initiator"
    assert wait_done(peer.ag, h) == "DONE"
    assert host(dst).tobytes() == orig
    peer.ag.release_xfer_handle(h)
    peer.call("set", 4 << 20, orig)


@pytest.mark.parametrize("size", [0, 64, 65, 4095, 4096, 100_000, 1 << 20])
def test_standalone_notifications_any_length(peer, size):
    msg = bytes(pattern(size, size))
    peer.ag.send_notif(peer.target, msg)
    got = peer.call("notifs", 1, DEADLINE_S)
    assert got == [("initiator", msg)]


def test_a_notification_flood_is_delivered_or_refused(peer):
    """200 notifications of 1 MiB to a peer that reads as it can: each
    send_notif succeeds and arrives whole, in order, or raises at the call;
    none is lost, and the connection lives on."""
    peer.pipe.send(("drain_until_quiet", 3.0))
    sent, refused = [], 0
    for i in range(200):
        msg = i.to_bytes(8, "little") * (1 << 17)  # 1 MiB
        try:
            peer.ag.send_notif(peer.target, msg)
            sent.append(i)
        except Exception:  # nixlBackendError: no room now
            refused += 1
    got = peer.call_raw()
    assert len(sent) + refused == 200
    assert [n for _, n, _, _ in got] == [1 << 20] * len(sent), (len(got), len(sent), refused)
    assert [int.from_bytes(h, "little") for _, _, h, _ in got] == sent
    assert all(a == "initiator" and h == t for a, _, h, t in got)
    peer.ag.send_notif(peer.target, b"still here")
    assert peer.call("notifs", 1, DEADLINE_S) == [("initiator", b"still here")]


def test_notifications_both_ways(peer):
    peer.call("notify", "initiator", b"from the target")
    end = time.monotonic() + DEADLINE_S
    got = {}
    while not got and time.monotonic() < end:
        got = peer.ag.get_new_notifs()
    assert got == {"target": [b"from the target"]}


def test_reposted_handle_with_new_message(peer, local):
    n = 64 << 10
    src = local(n, seed=31)
    l = peer.ag.get_xfer_descs([(addr(src), n, DEV)], MEM)
    h = peer.ag.initialize_xfer("WRITE", l, peer.remote(0, n), peer.target, b"first")
    for round_, msg in enumerate([b"first", b"second", b"third" * 2000]):
        src[:] = round_ + 1
        peer.ag.transfer(h, msg)
        assert wait_done(peer.ag, h) == "DONE"
        who, seen = peer.call("await_note", msg, 0, n)
        assert who == "initiator" and seen == host(src).tobytes()
    peer.ag.release_xfer_handle(h)


def test_handle_released_in_flight(peer, local):
    n = 6 << 20
    arr = new_buf(n, 41)
    descs = register(peer.ag, arr)
    l = peer.ag.get_xfer_descs([(addr(arr), n, DEV)], MEM)
    for op in ("WRITE", "READ"):
        h = peer.ag.initialize_xfer(op, l, peer.remote(0, n), peer.target, b"released")
        peer.ag.transfer(h)
        peer.ag.release_xfer_handle(h)
    # Deregistration waits for what is still on the wire; then the memory
    # is ours again.
    peer.ag.deregister_memory(descs)
    arr[:] = 0
    # The connection goes on.
    src = local(4096, seed=42)
    xfer(peer, "WRITE", src, 0, 0, 4096)
    assert peer.call("get", 0, 4096) == host(src).tobytes()
    # Notes of released transfers may or may not have been sent (the
    # transfer may have ended first); none other arrives.
    assert all(m == b"released" for _, m in peer.call("notifs", 0, 0.5))


def test_ten_thousand_descriptors_in_one_request(peer, local):
    count, piece, gap = 10_000, 64, 16
    span = count * (piece + gap)
    src = local(span, seed=51)
    loc = [(addr(src) + i * (piece + gap), piece, DEV) for i in range(count)]
    rem = [(peer.taddr + i * (piece + gap) + 3, piece, DEV) for i in range(count)]
    h = peer.ag.initialize_xfer(
        "WRITE",
        peer.ag.get_xfer_descs(loc, MEM),
        peer.ag.get_xfer_descs(rem, MEM),
        peer.target,
        b"10k",
    )
    peer.ag.transfer(h)
    assert wait_done(peer.ag, h) == "DONE"
    who, far = peer.call("await_note", b"10k", 3, span)
    far = np.frombuffer(far, dtype=np.uint8)
    src = host(src)
    for i in range(0, count, 97):
        at = i * (piece + gap)
        assert far[at : at + piece].tobytes() == src[at : at + piece].tobytes()
    got = np.concatenate([far[i * (piece + gap) :][:piece] for i in range(count)])
    want = np.concatenate([src[i * (piece + gap) :][:piece] for i in range(count)])
    assert (got == want).all()
    peer.ag.release_xfer_handle(h)


def test_vllm_nixl_connector_pattern(peer, local):
    """Decode READs KV blocks with a request id as the note; prefill frees
    (overwrites) the blocks when the note arrives."""
    layers, blocks, block = 4, 32, 4096
    layer_bytes = blocks * block
    kv = local(layers * layer_bytes, seed=61)
    remote_base = 2 << 20
    orig = np.frombuffer(peer.call("get", remote_base, layers * layer_bytes), dtype=np.uint8)

    def block_descs(base):
        return [(base + l * layer_bytes + b * block, block, DEV) for l in range(layers) for b in range(blocks)]

    local_h = peer.ag.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(addr(kv)), MEM)
    remote_h = peer.ag.prep_xfer_dlist(peer.target, block_descs(peer.taddr + remote_base), MEM)
    for req in range(blocks // 2):
        ids = [l * blocks + b for l in range(layers) for b in (2 * req, 2 * req + 1)]
        req_id = f"cmpl-{req:04d}-{'x' * 200}".encode()
        ranges = [(remote_base + i * block, block) for i in ids]
        peer.pipe.send(("await_note_clobber", req_id, ranges))
        h = peer.ag.make_prepped_xfer("READ", local_h, ids, remote_h, ids, req_id)
        peer.ag.transfer(h)
        assert peer.call_raw() == "initiator"
        assert wait_done(peer.ag, h) == "DONE"
        kv_now = host(kv)
        for i in ids:
            assert (kv_now[i * block : (i + 1) * block] == orig[i * block : (i + 1) * block]).all()
        peer.ag.release_xfer_handle(h)
    peer.ag.release_dlist_handle(local_h)
    peer.ag.release_dlist_handle(remote_h)
    peer.call("set", remote_base, orig.tobytes())


def test_threads_post_at_once(peer, local):
    """Every entry is thread-safe: four threads post, poll and release
    their own handles on one connection at the same time."""
    import threading

    threads, each, n = 4, 25, 8192
    src = local(threads * each * n, seed=81)
    errors = []

    def run(t):
        try:
            for i in range(each):
                at = (t * each + i) * n
                l = peer.ag.get_xfer_descs([(addr(src) + at, n, DEV)], MEM)
                h = peer.ag.initialize_xfer("WRITE", l, peer.remote(at, n), peer.target, f"t{t}-{i}".encode())
                peer.ag.transfer(h)
                assert wait_done(peer.ag, h) == "DONE"
                peer.ag.release_xfer_handle(h)
        except Exception as e:  # reported below, with the thread
            errors.append((t, e))

    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(DEADLINE_S)
    assert not errors, errors
    want = sorted(f"t{t}-{i}".encode() for t in range(threads) for i in range(each))
    got, end = [], time.monotonic() + DEADLINE_S
    while len(got) < len(want) and time.monotonic() < end:
        # (A note of an earlier test's released transfer may still come.)
        got += [m for _, m in peer.call("notifs", 1, 1.0) if m != b"released"]
    assert sorted(got) == want
    assert peer.call("get", 0, threads * each * n) == host(src).tobytes()


def test_nixl_telemetry_counts_ferry_transfers(peer, local):
    """NIXL's own telemetry sees FERRY's transfers: an agent made with
    `capture_telemetry` reports, per request, the bytes and descriptors
    the FERRY backend moved and how long it took. (NIXL records this in
    the agent for every backend; the backend's own event queue,
    `nixlBackendEngine::addTelemetryEvent`, is not read by NIXL's core.)"""
    conf = nixl_agent_config(backends=[BACKEND], capture_telemetry=True)
    ag = nixl_agent("telemetry", conf)
    assert ag.add_remote_agent(peer.tmeta) == peer.target.encode()
    assert peer.call("meta", ag.get_agent_metadata()) == b"telemetry"
    src = local(3 * 4096 + 100, seed=91, ag=ag)
    pieces = [(0, 4096), (4096 + 17, 4096), (2 * 4096 + 50, 4096 + 50)]
    total = sum(n for _, n in pieces)
    for op in ("WRITE", "READ"):
        l = ag.get_xfer_descs([(addr(src) + o, n, DEV) for o, n in pieces], MEM)
        r = ag.get_xfer_descs([(peer.taddr + 1000 + o, n, DEV) for o, n in pieces], MEM)
        h = ag.initialize_xfer(op, l, r, peer.target)
        assert ag.transfer(h) in ("PROC", "DONE")
        assert wait_done(ag, h) == "DONE"
        t = ag.get_xfer_telemetry(h)
        assert (t.totalBytes, t.descCount) == (total, len(pieces)), op
        assert t.xferDuration > 0 and t.startTime > 0, op
        ag.release_xfer_handle(h)
    assert peer.call("get", 1000, 4096) == host(src)[:4096].tobytes()


def test_ucx_stays_available_beside_ferry():
    ag = nixl_agent("both", nixl_agent_config(backends=["FERRY", "UCX"]))
    assert {"FERRY", "UCX"} <= set(ag.get_plugin_list())
    assert {"FERRY", "UCX"} <= set(ag.backends)
    assert ag.get_backend_mem_types("FERRY") == ["DRAM_SEG", "VRAM_SEG"]


def _ferry_meta(agent_metadata):
    """The FERRY conn info (ferry metadata) inside NIXL agent metadata."""
    at = agent_metadata.index(b"FERRY|c") + len(b"FERRY|c")
    n = int.from_bytes(agent_metadata[at : at + 8], "little")
    return agent_metadata[at + 8 : at + 8 + n]


class RawFerry:
    """A peer speaking ferry itself (the plugin's own C face, by ctypes):
    it can send the plugin notifications NIXL never would."""

    def __init__(self, meta):
        import ctypes

        so = os.path.join(os.environ["NIXL_PLUGIN_DIR"], "libplugin_FERRY.so")
        self.c = ctypes
        self.lib = ctypes.CDLL(so)
        self.ep = ctypes.c_void_p()
        assert self.lib.ferry_endpoint_create(None, ctypes.byref(self.ep)) == 0
        self.conn = ctypes.c_uint64()
        assert self.lib.ferry_add_remote(self.ep, meta, len(meta), ctypes.byref(self.conn)) == 0

    def note(self, b):
        end = time.monotonic() + DEADLINE_S
        while True:
            rc = self.lib.ferry_send_notification(self.ep, self.conn, b, len(b))
            if rc != -5 or time.monotonic() > end:  # FERRY_ERR_BUSY: room soon
                break
            time.sleep(0.0005)
        assert rc == 0, rc

    def try_note(self, b):
        """Sends one notification; its status (the plugin may have
        dropped this connection)."""
        return self.lib.ferry_send_notification(self.ep, self.conn, b, len(b))

    def inbox_empty(self):
        c, n = self.c.c_uint64(), self.c.c_size_t()
        buf = self.c.create_string_buffer(4096)
        rc = self.lib.ferry_recv_notification(self.ep, 0, self.c.byref(c), buf, 4096, self.c.byref(n))
        return rc == -2  # FERRY_ERR_TIMEOUT: nothing came

    def piece(self, msg_id, idx, count, body):
        hdr = b"L" + msg_id.to_bytes(8, "little") + idx.to_bytes(4, "little") + count.to_bytes(4, "little")
        self.note(hdr + body)

    def close(self):
        self.lib.ferry_endpoint_destroy(self.ep)


PIECE = 4096 - 17


def test_hostile_notifications_are_bounded_and_dropped(peer):
    raw = RawFerry(_ferry_meta(peer.ag.get_agent_metadata()))

    def drain(deadline=2.0):
        got, end = [], time.monotonic() + deadline
        while time.monotonic() < end:
            for agent, msgs in peer.ag.get_new_notifs().items():
                got += [(agent, m) for m in msgs]
            time.sleep(0.01)
        return got

    try:
        raw.note(b"Nbefore hello")  # no hello yet: dropped
        raw.note(b"Hmallory")
        raw.note(b"Xunknown kind")  # dropped
        raw.note(b"L\x01\x02")  # a short piece: dropped
        raw.piece(1, 5, 2, b"x")  # index past count: dropped
        raw.piece(2, 0, 1 << 20, b"x" * PIECE)  # count past the bound: dropped
        # 65 unfinished messages: the first goes when the 65th comes.
        for i in range(65):
            raw.piece(100 + i, 0, 2, b"a" * PIECE)
        raw.piece(100, 1, 2, b"end")
        raw.piece(164, 1, 2, b"end")
        # Two messages of ~1 MiB each, unfinished, then a third: past the
        # byte bound the oldest goes.
        count = (1 << 20) // PIECE
        for msg_id in (200, 201, 202):
            for i in range(count - 1):
                raw.piece(msg_id, i, count, bytes([msg_id % 256]) * PIECE)
        for msg_id in (200, 202):
            raw.piece(msg_id, count - 1, count, b"!")
        raw.note(b"Nafter")
        got = drain()
        want_long = bytes([202 % 256]) * (PIECE * (count - 1)) + b"!"
        assert [a for a, _ in got] == ["mallory"] * 3, [(a, m[:20]) for a, m in got]
        msgs = [m for _, m in got]
        assert msgs[0] == b"a" * PIECE + b"end"
        assert msgs[1] == want_long
        assert msgs[2] == b"after"
    finally:
        raw.close()


def _drain(ag, deadline=1.5):
    """What `ag` reports for `deadline` seconds (get_new_notifs must not
    raise, whatever peers sent)."""
    got, end = [], time.monotonic() + deadline
    while time.monotonic() < end:
        for agent, msgs in ag.get_new_notifs().items():
            got += [(agent, bytes(m)) for m in msgs]
        time.sleep(0.01)
    return got


def test_a_name_another_connection_holds_is_refused(peer):
    peer.call("notify", "initiator", b"the real target")
    assert ("target", b"the real target") in _drain(peer.ag)
    raw = RawFerry(_ferry_meta(peer.ag.get_agent_metadata()))
    try:
        raw.try_note(b"Htarget")  # the target's connection holds it
        raw.try_note(b"Nspoofed")
        assert all(m != b"spoofed" for _, m in _drain(peer.ag))
        peer.call("notify", "initiator", b"still the target")
        assert ("target", b"still the target") in _drain(peer.ag)
    finally:
        raw.close()


def test_a_squatter_never_receives_what_is_meant_for_the_agent(local):
    """A peer that says hello as an agent before that agent does gets
    none of what is sent to it: transfers and notifications go over the
    connection made to the conn info NIXL loaded."""
    p = Peer("initiator6", target="late")
    raw = RawFerry(_ferry_meta(p.ag.get_agent_metadata()))
    try:
        raw.try_note(b"Hlate")
        _drain(p.ag, 0.3)
        p.ag.send_notif("late", b"for late only")
        assert p.call("notifs", 1, DEADLINE_S) == [("initiator6", b"for late only")]
        src = local(4096, seed=81, ag=p.ag)
        xfer(p, "WRITE", src, 0, 0, 4096)
        assert p.call("get", 0, 4096) == host(src).tobytes()
        assert raw.inbox_empty()
    finally:
        raw.close()
        p.close()


def test_a_squatter_on_a_known_agents_name_is_refused_and_the_agent_is_not(local):
    """An agent whose metadata we loaded is proven, not believed: a peer
    that says hello as it first is dropped (the agent's endpoint does not
    vouch for its connection), and the agent's own hello after it holds
    the name."""
    p = Peer("initiator7", target="known")
    raw = RawFerry(_ferry_meta(p.ag.get_agent_metadata()))
    try:
        raw.try_note(b"Hknown")
        raw.try_note(b"Nspoofed")
        got = _drain(p.ag, 0.5)
        assert all(m != b"spoofed" for _, m in got), got
        assert p.call("notify", "initiator7", b"the real one")
        assert ("known", b"the real one") in _drain(p.ag)
    finally:
        raw.close()
        p.close()


def test_a_name_claimed_before_its_metadata_is_proven_when_it_comes(local):
    """A name NIXL knows nothing of yet is first come; once the agent's
    metadata is loaded the claimant must be vouched for by that agent or
    is dropped, and the real agent then holds the name."""
    p = Peer("initiator8", target="early", load_target=False)
    raw = RawFerry(_ferry_meta(p.ag.get_agent_metadata()))
    try:
        raw.try_note(b"Hearly")
        raw.try_note(b"Nbefore the metadata")
        assert ("early", b"before the metadata") in _drain(p.ag, 0.5)
        assert p.ag.add_remote_agent(p.tmeta) == b"early"
        raw.try_note(b"Nafter the metadata")
        got = _drain(p.ag, 0.5)
        assert all(m != b"after the metadata" for _, m in got), got
        assert p.call("notify", "initiator8", b"the real one")
        assert ("early", b"the real one") in _drain(p.ag)
    finally:
        raw.close()
        p.close()


def test_bad_names_and_name_floods_are_refused(peer):
    """A name that is not UTF-8 or too long, or a second hello with
    another name, drops the connection: what it sends after is never
    reported, and get_new_notifs never raises."""
    meta = _ferry_meta(peer.ag.get_agent_metadata())
    raws = [RawFerry(meta) for _ in range(3)]
    try:
        raws[0].try_note(b"H\xff\xfe not utf-8")
        raws[1].try_note(b"H" + b"x" * 4000)
        raws[2].try_note(b"Hfirst-name")
        for i in range(2000):  # a flood of names on one connection
            if raws[2].try_note(b"Hname-%d" % i) != 0:
                break
        for r in raws:
            r.try_note(b"Nafter a bad hello")
        got = _drain(peer.ag)
        assert all(m != b"after a bad hello" for _, m in got), got
    finally:
        for r in raws:
            r.close()


def test_bad_remote_metadata_is_an_error(peer):
    with pytest.raises(Exception):
        peer.ag.add_remote_agent(b"not metadata at all")
    good = peer.ag.get_agent_metadata()
    with pytest.raises(Exception):
        peer.ag.add_remote_agent(good[: len(good) // 2])


def _write_until_it_fails(ag, local_descs, remote_descs, agent):
    """WRITEs until one does not end DONE; the state it ended in, or the
    class name of what NIXL raised (nixlRemoteDisconnectError and kin)."""
    end = time.monotonic() + DEADLINE_S
    state = None
    while time.monotonic() < end:
        try:
            h = ag.initialize_xfer("WRITE", local_descs, remote_descs, agent)
            state = ag.transfer(h)
            if state != "ERR":
                state = wait_done(ag, h)
        except Exception as e:
            state = type(e).__name__
        if state != "DONE":
            break
        time.sleep(0.05)
    return state


def test_killed_peer_is_an_error_not_a_hang(local):
    p = Peer("initiator2", target="doomed")
    src = local(1 << 20, seed=71, ag=p.ag)
    xfer(p, "WRITE", src, 0, 0, 1 << 20)
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.join(10)
    l = p.ag.get_xfer_descs([(addr(src), 1 << 20, DEV)], MEM)
    state = _write_until_it_fails(p.ag, l, p.remote(0, 1 << 20), "doomed")
    # NIXL_ERR_REMOTE_DISCONNECT, as NIXL's Python API raises it.
    assert state == "nixlRemoteDisconnectError", state
    with pytest.raises(Exception, match="REMOTE_DISCONNECT"):
        p.ag.send_notif("doomed", b"anyone?")


def _rogue_ferry_peer():
    """A peer that completes ferry's handshake (a real HelloAck to each
    stream's Hello: no capabilities, no host token) and then sends a frame
    header of garbage: a protocol violation. Returns its port."""
    import socket
    import threading

    l = socket.socket()
    l.bind(("127.0.0.1", 0))
    l.listen(16)

    def serve(s):
        with s:
            s.settimeout(DEADLINE_S)
            head = s.recv(12, socket.MSG_WAITALL)
            n = int.from_bytes(head[8:12], "little")
            body = bytearray(s.recv(n, socket.MSG_WAITALL))
            # Hello -> HelloAck: kind byte 6; endpoint_id 7, caps 0, host token 0.
            ack = bytearray(head)
            ack[6] = 2
            body[0:8] = (7).to_bytes(8, "little")
            body[8:12] = bytes(4)
            body[28:36] = bytes(8)
            s.sendall(bytes(ack) + bytes(body) + b"\xee" * 64)
            while s.recv(65536):
                pass

    def accept():
        with l:
            for _ in range(8):
                s, _ = l.accept()
                threading.Thread(target=serve, args=(s,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return l.getsockname()[1]


def test_misbehaving_peer_is_not_allowed_apart_from_gone_and_timeout(local):
    """An agent whose conn info leads to a peer that breaks ferry's
    protocol: its transfers fail with NIXL_ERR_NOT_ALLOWED — a cause apart
    from a peer gone (REMOTE_DISCONNECT) and a silent one (BACKEND)."""
    if os.environ.get("FERRY_TRANSPORT") == "shm":
        pytest.skip("the rogue peer speaks tcp; run_tests.sh runs this under FERRY_TRANSPORT=tcp")
    decoy = make_agent("decoy")
    buf = new_buf(4096, 3)
    register(decoy, buf)
    md = bytearray(decoy.get_agent_metadata())
    at = md.index(b"FERRY|c") + len(b"FERRY|c") + 8
    # The conn info is ferry's metadata: IPv4, then the port (big-endian).
    md[at + 4 : at + 6] = _rogue_ferry_peer().to_bytes(2, "big")
    victim = make_agent("victim")
    assert victim.add_remote_agent(bytes(md)) == b"decoy"
    src = new_buf(4096, 4)
    register(victim, src)
    l = victim.get_xfer_descs([(addr(src), 4096, DEV)], MEM)
    r = victim.get_xfer_descs([(addr(buf), 4096, DEV)], MEM)
    state = _write_until_it_fails(victim, l, r, "decoy")
    assert state == "nixlNotAllowedError", state


def test_stopped_peer_is_a_backend_error_not_a_disconnect(local, monkeypatch):
    """A peer that stops answering (SIGSTOP: alive, silent) fails the
    connection at ferry's op timeout: NIXL_ERR_BACKEND, a cause apart from
    a peer that is gone (NIXL_ERR_REMOTE_DISCONNECT, above)."""
    if VRAM and os.environ.get("FERRY_TRANSPORT") != "tcp":
        # GPU memory on one host moves by CUDA IPC, copied by this process
        # alone: a stopped peer's memory still takes the WRITEs (seen on
        # the GPU machine: every one DONE), so nothing here can time out.
        pytest.skip("CUDA IPC copies need nothing of the peer; run with FERRY_TRANSPORT=tcp")
    monkeypatch.setenv("FERRY_OP_TIMEOUT_MS", "800")
    p = Peer("initiator3", target="frozen")
    src = local(1 << 20, seed=73, ag=p.ag)
    xfer(p, "WRITE", src, 0, 0, 1 << 20)
    os.kill(p.proc.pid, signal.SIGSTOP)
    try:
        l = p.ag.get_xfer_descs([(addr(src), 1 << 20, DEV)], MEM)
        state = _write_until_it_fails(p.ag, l, p.remote(0, 1 << 20), "frozen")
        assert state == "nixlBackendError", state
    finally:
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.join(10)


def _vtable(so, cls):
    """The slots of `vtable for cls` in `so`: for each, the set of
    demangled method names (without their class) at its address — a set,
    since a linker may fold identical functions (two `return true;`
    methods) into one address."""

    def run(*a):
        return subprocess.run(a, capture_output=True, text=True, check=True).stdout

    syms, vt = {}, None
    for line in run("nm", "-S", so).splitlines():
        p = line.split(None, 3)
        if len(p) == 4 and re.fullmatch(r"[0-9a-f]{8,}", p[0]) and re.fullmatch(r"[0-9a-f]{8,}", p[1]):
            syms.setdefault(int(p[0], 16), []).append(p[3])
    for line in run("nm", "-S", "-C", so).splitlines():
        p = line.split(None, 3)
        if len(p) == 4 and p[3] == "vtable for " + cls:
            vt = (int(p[0], 16), int(p[1], 16))
    assert vt is not None, f"no vtable for {cls} in {so} (a build stripped of its symbol table has none: strip --strip-debug keeps it)"
    relocs = {}
    for line in run("readelf", "-rW", so).splitlines():
        f = line.split()
        if len(f) >= 4 and re.fullmatch(r"[0-9a-f]{12,}", f[0]) and f[2] == "R_X86_64_RELATIVE":
            relocs[int(f[0], 16)] = syms.get(int(f[3], 16), ["?"])
        elif len(f) >= 5 and re.fullmatch(r"[0-9a-f]{12,}", f[0]) and f[2] == "R_X86_64_64":
            relocs[int(f[0], 16)] = [f[4].split("@")[0]]
    out = []
    for at in range(vt[0] + 16, vt[0] + vt[1], 8):
        names = set()
        for mangled in relocs.get(at, ["?"]):
            name = run("c++filt", mangled).strip()
            name = name.replace("(anonymous namespace)::", "")
            name = re.sub(r"^\w+::", "", name)  # the class
            names.add(re.sub(r"^~\w+\(\)", "~()", name))
        out.append(names)
    return out


@pytest.mark.skipif(not os.environ.get("NIXL_PLUGIN_DIR"), reason="needs NIXL_PLUGIN_DIR")
def test_vtable_matches_nixl():
    """Our declaration of NIXL's engine (nixl/cpp/nixl_abi.h) against the
    one NIXL's own POSIX plugin of the installed wheel was built with."""
    import nixl

    pkg = os.path.dirname(nixl._bindings.__file__)
    theirs = None
    for d in os.listdir(os.path.dirname(pkg)):
        cand = os.path.join(os.path.dirname(pkg), d, "plugins", "libplugin_POSIX.so")
        if d.startswith(".nixl") and os.path.exists(cand):
            theirs = cand
    assert theirs, "the wheel's libplugin_POSIX.so"
    ours = os.path.realpath(os.path.join(os.environ["NIXL_PLUGIN_DIR"], "libplugin_FERRY.so"))
    want = _vtable(theirs, "nixlPosixEngine")
    got = _vtable(ours, "(anonymous namespace)::nixlFerryEngine")
    assert any("checkXfer(nixlBackendReqH*) const" in w for w in want)
    assert len(got) == len(want), (got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g & w, f"slot {i}: ours {sorted(g)}, NIXL's {sorted(w)}"
