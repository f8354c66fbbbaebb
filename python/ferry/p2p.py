"""The seed's Python API (UCCL P2P's ``p2p`` module), name for name.

Change ``from uccl import p2p`` to ``from ferry import p2p``; the rest of a
script stays as it is. Differences a script may notice:

* calls that the seed aborts on return ``ok=False`` and log why on the
  ``ferry`` logger (``Endpoint(..., strict=True)`` raises ``FerryError``
  instead);
* ``advertise`` takes the seed's wheel form ``(conn_id, mr_id, ptr, size)``
  (a key for that connection only) and its repository's form
  ``(mr_id, ptr, size)`` (a key any connected peer may use);
* ``connect_local`` takes a GPU bus id (the wheel), a GPU index (older
  tests) or the peer's metadata bytes (works without a GPU);
* ``*_ipc`` calls also take host pointers: their windows are then ordinary
  ones, moved over shared memory or tcp;
* the window and descriptor bytes are ferry's (a ferry peer reads them; a
  UCCL peer does not), the metadata bytes are the seed's;
* two-sided ``send``/``recv`` (and their ``v``, ``_ipc`` and ``_async``
  forms) are matched in order per connection as in the seed; the receiver
  reads the message from the sender's memory, so ``send`` returns once the
  peer took it, and a message longer than the posted buffer fails on both
  sides (``recv``'s ``size`` is cut to its registration's end).

This module is the seed's bookkeeping only: integer ids for registrations,
connections and transfers, ``(ok, ...)`` tuples and the sixteen operation
variants, over the native ``Endpoint``, ``Region``, ``Connection``,
``Transfer`` and ``Message`` (which check every range, window and connection). Raw
pointers are the caller's promise, as in the seed: memory given to ``reg``
(or met by an ``*_ipc`` call, which registers the containing GPU
allocation, or the exact host range, on first use) must stay valid until
``dereg`` (or ``close``) returns.
"""

from __future__ import annotations

import bisect
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _native
from ._native import FerryError, FloatType, UINT64_MAX, XferDesc, get_oob_ip

kUndefined = FloatType.kUndefined
kFloat16 = FloatType.kFloat16
kBFloat16 = FloatType.kBFloat16
kFloat32 = FloatType.kFloat32
kFloat8E4M3FN = FloatType.kFloat8E4M3FN
kFloat8E5M2 = FloatType.kFloat8E5M2
# The seed's FloatType numbers -> the codec's names.
_SEED_DTYPES = {1: "fp16", 2: "bf16", 3: "fp32", 4: "fp8-e4m3", 5: "fp8-e5m2"}


def _seed_dtype(ft: Any) -> Optional[str]:
    if ft is None:
        return None
    try:
        return _SEED_DTYPES.get(int(ft))
    except (TypeError, ValueError):
        return None

_REMOTE_LEN = _native.REMOTE_BUF_LEN
_IPC_LEN = _native.IPC_BUF_LEN
# Registrations looked at, nearest address first, to find one holding a raw
# pointer before registering it anew.
_CONTAINING_SCAN = 64

_log = logging.getLogger("ferry")


class XferHandle:
    """The seed's record of a started transfer (conn_id, op_name, transfer_id)."""

    __slots__ = ("conn_id", "op_name", "transfer_id")

    def __init__(self, conn_id: int, op_name: str, transfer_id: int) -> None:
        self.conn_id = conn_id
        self.op_name = op_name
        self.transfer_id = transfer_id

    def __repr__(self) -> str:
        return f"<XferHandle conn_id={self.conn_id} op={self.op_name} id={self.transfer_id}>"


class _Group:
    """Several messages filed under one transfer id (``sendv_async``):
    done when all are; the first failure is raised."""

    def __init__(self, parts: List[Any]) -> None:
        self._parts = parts

    def done(self) -> bool:
        return all([p.done() for p in self._parts])

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        return all(p.wait(timeout_s) for p in self._parts)


class _Failed(Exception):
    """A call's reason to return ``ok=False`` (or raise, when strict)."""


def _len_mismatch(what: str) -> FerryError:
    return FerryError(f"{what}: all input vectors/lists must have length num_iovs")


def _tensor_info(t: Any) -> Tuple[int, int]:
    """(address, bytes) of a tensor as the seed reads it, or of an object
    with numpy's array interface."""
    if hasattr(t, "data_ptr"):
        return int(t.data_ptr()), int(t.numel()) * int(t.element_size())
    ai = getattr(t, "__array_interface__", None)
    if ai is not None:
        return int(ai["data"][0]), int(t.nbytes)
    raise FerryError(
        f"{type(t).__name__} is not a tensor (no data_ptr()) nor an array (no __array_interface__)"
    )


class Endpoint:
    """The seed's ``Endpoint(local_gpu_idx=None, num_cpus=..., strict=False)``.

    With a GPU index the endpoint serves that GPU; without one it is lazy
    (the first GPU pointer registered picks it). Extra positional arguments
    (the seed's ``num_cpus``) are accepted and ignored. Settings come from
    ``FERRY_*`` variables (and the seed's ``UCCL_P2P_*`` where one matches).
    """

    def __init__(self, local_gpu_idx: Optional[int] = None, *_ignored: Any, strict: bool = False) -> None:
        self._strict = strict
        if local_gpu_idx is not None and _native.gpu_count() == 0:
            # Clients written for GPU hosts pass GPU 0 everywhere (Ray's
            # tensor transport does); with no GPU here, host memory is
            # still served.
            _log.warning(
                "Endpoint(local_gpu_idx=%s): no GPU is visible here; serving host memory only",
                local_gpu_idx,
            )
            local_gpu_idx = None
        self._n: Optional[_native.Endpoint] = _native.Endpoint(local_gpu_idx)
        self._lock = threading.Lock()
        self._regs: Dict[int, _native.Region] = {}
        # (address, mr_id), sorted: registrations by address.
        self._by_addr: List[Tuple[int, int]] = []
        # The registration `_containing` found last, as (start, end,
        # region): a caller's ops mostly land in one buffer, and the look
        # there costs ~0.7 us (lock, bisect, a native call) a blocking op.
        # Dropped whenever a registration goes (`_take`, `close`).
        self._hit: Optional[Tuple[int, int, _native.Region]] = None
        self._next_mr = 0
        self._xfers: Dict[int, _native.Transfer] = {}
        self._next_xfer = 0

    # ---- plumbing --------------------------------------------------------

    def _ep(self) -> _native.Endpoint:
        if self._n is None:
            raise _Failed("the endpoint is closed")
        return self._n

    def _fail(self, what: str, e: BaseException, default: Any) -> Any:
        msg = f"{what}: {e}"
        if self._strict:
            raise FerryError(msg)
        _log.warning(msg)
        return default

    def _call(self, what: str, default: Any, f: Callable[[], Any]) -> Any:
        """``f()``, or ``default`` (logged; raised when strict) when it fails."""
        try:
            return f()
        except (FerryError, _Failed) as e:
            return self._fail(what, e, default)

    def _add(self, region: _native.Region) -> int:
        with self._lock:
            mr_id = self._next_mr
            self._next_mr += 1
            self._regs[mr_id] = region
            bisect.insort(self._by_addr, (region.ptr, mr_id))
            return mr_id

    def _take(self, mr_id: int) -> Optional[_native.Region]:
        with self._lock:
            self._hit = None
            r = self._regs.pop(mr_id, None)
            if r is not None:
                i = bisect.bisect_left(self._by_addr, (r.ptr, mr_id))
                del self._by_addr[i]
            return r

    def _mr(self, mr_id: int) -> _native.Region:
        r = self._regs.get(mr_id)
        if r is None:
            raise _Failed(f"unknown mr_id {mr_id}")
        return r

    def _containing(self, ptr: int, size: int) -> Optional[_native.Region]:
        hit = self._hit
        if hit is not None and hit[0] <= ptr and ptr + size <= hit[1] and size >= 0:
            return hit[2]
        with self._lock:
            i = bisect.bisect_right(self._by_addr, (ptr, UINT64_MAX))
            for addr, mr_id in reversed(self._by_addr[max(0, i - _CONTAINING_SCAN):i]):
                r = self._regs[mr_id]
                if r.contains(ptr, size):
                    self._hit = (r.ptr, r.ptr + r.nbytes, r)
                    return r
        return None

    def _by_ptr(self, ptr: int, size: int) -> _native.Region:
        """A registration holding ``[ptr, ptr + size)``: an existing one,
        else the containing GPU allocation, or the exact host range,
        registered now (the seed's ``*_ipc`` calls take bare pointers)."""
        r = self._containing(ptr, size)
        if r is not None:
            return r
        ep = self._ep()
        base, n = ep.allocation_of(ptr, size)
        r = ep.register(base, n)
        self._add(r)
        return r

    def _conn(self, conn_id: int) -> _native.Connection:
        # The seed refuses an unknown connection before posting.
        return self._ep().connection(conn_id)

    def _keep(self, t: _native.Transfer) -> int:
        with self._lock:
            tid = self._next_xfer
            self._next_xfer += 1
            self._xfers[tid] = t
            return tid

    def _run(self, what: str, conn_id: int, write: bool, pieces: Callable[[], Tuple[list, list]], blocking: bool) -> Tuple[bool, int]:
        """Submits one operation and waits (``blocking``: ``(ok, 0)``) or
        files it (``(ok, transfer_id)``)."""
        try:
            conn = self._conn(conn_id)
            locals_, windows = pieces()
            if blocking:
                # Submitted and waited in one native call (one GIL release).
                conn.run(write, locals_, windows)
                return True, 0
            t = conn.submit(write, locals_, windows)
        except (FerryError, _Failed) as e:
            return self._fail(what, e, (False, 0))
        return True, self._keep(t)

    @staticmethod
    def _window(what: str, meta: Any) -> bytes:
        if not isinstance(meta, (bytes, bytearray)):
            raise FerryError(f"{what}: each window must be bytes")
        return bytes(meta)

    def _single(self, what: str, write: bool, conn_id: int, mr_id: int, ptr: int, size: int, meta: bytes, blocking: bool) -> Tuple[bool, int]:
        if len(meta) != _REMOTE_LEN:
            raise FerryError(
                f"{what}: meta must be exactly {_REMOTE_LEN} bytes (the peer's advertise), not {len(meta)}"
            )
        return self._run(what, conn_id, write, lambda: ([(self._mr(mr_id), ptr, size)], [bytes(meta)]), blocking)

    def _vector(self, what: str, write: bool, conn_id: int, mr_id_v: Sequence[int], ptr_v: Sequence[int], size_v: Sequence[int], meta_v: Sequence[bytes], num_iovs: int, blocking: bool) -> Tuple[bool, int]:
        if not (len(mr_id_v) == len(ptr_v) == len(size_v) == len(meta_v) == num_iovs):
            raise _len_mismatch(what)
        wins = [self._window(what, m) for m in meta_v]
        return self._run(
            what,
            conn_id,
            write,
            lambda: ([(self._mr(m), p, s) for m, p, s in zip(mr_id_v, ptr_v, size_v)], wins),
            blocking,
        )

    def _ipc(self, what: str, write: bool, conn_id: int, ptr_v: Sequence[int], size_v: Sequence[int], info_v: Sequence[bytes], blocking: bool) -> Tuple[bool, int]:
        if not (len(ptr_v) == len(size_v) == len(info_v)):
            raise FerryError(f"{what}: ptr_v, size_v and info_v must have the same length")
        return self._run(
            what,
            conn_id,
            write,
            lambda: ([(self._by_ptr(p, s), p, s) for p, s in zip(ptr_v, size_v)], [bytes(i) for i in info_v]),
            blocking,
        )

    # ---- the endpoint ------------------------------------------------------

    def __repr__(self) -> str:
        return repr(self._n).replace("ferry Endpoint", "ferry P2P Endpoint", 1) if self._n else "<ferry P2P Endpoint (closed)>"

    def close(self) -> None:
        """Closes the endpoint: drops every registration and unfinished
        transfer id and shuts the engine down."""
        n, self._n = self._n, None
        with self._lock:
            regs, self._regs, self._by_addr = self._regs, {}, []
            self._hit = None
            self._xfers = {}
        for r in regs.values():
            try:
                r.close()
            except FerryError as e:
                _log.warning("close: %s", e)
        if n is not None:
            n.close()

    @property
    def endpoint_id(self) -> int:
        """This endpoint's id (ferry's; what ``accept_local`` reports of a peer)."""
        return self._ep_strict().id

    def _ep_strict(self) -> _native.Endpoint:
        try:
            return self._ep()
        except _Failed as e:
            raise FerryError(str(e)) from None

    @property
    def gpu(self) -> Optional[int]:
        """The GPU index this endpoint serves, or None (lazy, none yet)."""
        return self._ep_strict().gpu

    # ---- connections ---------------------------------------------------

    def get_metadata(self) -> bytes:
        """The seed's metadata bytes: address, port and GPU bus id."""
        return self._ep_strict().metadata

    @staticmethod
    def parse_metadata(metadata: bytes) -> Tuple[str, int, str]:
        """``(ip, port, gpu_bdf)`` of metadata bytes."""
        return _native.Endpoint.parse_metadata(bytes(metadata))

    @staticmethod
    def get_oob_ip() -> str:
        return get_oob_ip()

    def connect(self, remote_ip_addr: str, remote_gpu_bdf: Any = None, remote_port: int = -1) -> Tuple[bool, int]:
        """``(ok, conn_id)``. ferry listens on the port in the metadata; a
        negative port means this endpoint's own ``FERRY_LISTEN_PORT``."""

        def go() -> Tuple[bool, int]:
            ep = self._ep()
            port = remote_port
            if port <= 0:
                if remote_port < 0 and ep.listen_port != 0:
                    port = ep.listen_port
                else:
                    raise _Failed(
                        f"port {remote_port}: pass the port from parse_metadata (this endpoint "
                        "has no FERRY_LISTEN_PORT to assume)"
                    )
            return True, ep.connect(remote_ip_addr, port).id

        return self._call("connect", (False, 0), go)

    def accept(self) -> Tuple[bool, str, int, int]:
        """``(ok, ip, gpu_idx, conn_id)``: waits for one connection (Ctrl-C
        interrupts). A same-host peer reports ip "127.0.0.1"; the peer's
        GPU index is not sent, so it is -1."""

        def go() -> Tuple[bool, str, int, int]:
            conn, (kind, addr) = self._ep().accept()
            ip = addr.rsplit(":", 1)[0].strip("[]") if kind == "tcp" else "127.0.0.1"
            return True, ip, -1, conn.id

        return self._call("accept", (False, "", -1, 0), go)

    def start_passive_accept(self) -> bool:
        """Accepts connections in a background thread from now on."""
        return self._call("start_passive_accept", False, lambda: self._ep().start_passive_accept() or True)

    def add_remote_endpoint(self, metadata: bytes) -> Tuple[bool, int]:
        """``(ok, conn_id)``: connects once per remote endpoint (a same-host
        one over shared memory)."""
        return self._call("add_remote_endpoint", (False, 0), lambda: (True, self._ep().add_remote(bytes(metadata)).id))

    def remove_remote_endpoint(self, conn_id: int) -> bool:
        return self._call("remove_remote_endpoint", False, lambda: self._conn(conn_id).close() or True)

    def connect_local(self, remote: Any) -> Tuple[bool, int]:
        """``(ok, conn_id)`` over shared memory, to the same-host endpoint
        that serves GPU ``remote`` (a bus id as in the metadata, or a GPU
        index), or whose metadata bytes ``remote`` is."""

        def go() -> Tuple[bool, int]:
            ep = self._ep()
            if isinstance(remote, (bytes, bytearray)):
                return True, ep.add_remote(bytes(remote)).id
            if isinstance(remote, int):
                peer = _native.endpoint_of_gpu(_native.gpu_bus_id(remote))
            elif isinstance(remote, str):
                peer = _native.endpoint_of_gpu(remote)
            else:
                raise _Failed("remote must be a GPU bus id (str), a GPU index (int) or metadata (bytes)")
            return True, ep.connect_local(peer).id

        return self._call("connect_local", (False, 0), go)

    def accept_local(self) -> Tuple[bool, str, int]:
        """``(ok, remote_gpu_bdf, conn_id)``: waits for one same-host
        connection; the bus id is the peer's GPU if it published one, else ""."""

        def go() -> Tuple[bool, str, int]:
            conn, peer = self._ep().accept_local()
            return True, _native.gpu_of_endpoint(peer), conn.id

        return self._call("accept_local", (False, "", 0), go)

    def peer(self, conn_id: int) -> Optional[Tuple[str, str]]:
        """ferry's: who is at the other end of ``conn_id``: ``("tcp",
        "ip:port")`` or ``("shm", "<endpoint id>")``; None for an unknown or
        closed one."""
        return self._n.peer(conn_id) if self._n is not None else None

    def conn_id_of_rank(self, rank: int) -> int:
        """The seed keeps a rank -> connection map that nothing fills;
        ``UINT64_MAX`` means unknown, as there."""
        return UINT64_MAX

    # ---- memory ---------------------------------------------------------

    def reg(self, ptr: int, size: int, floatType: Any = None, *, readonly: bool = False) -> Tuple[bool, int]:
        """``(ok, mr_id)``. The memory (host or GPU) must stay valid until
        ``dereg(mr_id)`` returns. ferry's ``readonly=True`` lets peers only
        READ it, and it is never the destination of this side's READs (for
        memory Python considers immutable, such as ``bytes``)."""

        def go() -> Tuple[bool, int]:
            r = self._ep().register(ptr, size, readonly)
            name = _seed_dtype(floatType)
            if name is not None:
                # The seed's float_type: tcp transfers of it may be compressed.
                r.set_dtype(name)
            return True, self._add(r)

        return self._call("reg", (False, 0), go)

    def alloc_host(self, size: int) -> Tuple[bool, int, int]:
        """ferry's: ``(ok, mr_id, ptr)``: ``size`` zeroed bytes of host memory
        the engine owns, registered; a memfd shared with same-host peers, so
        their transfers into or out of it are one memcpy. Freed by
        ``dereg(mr_id)`` (or ``close``): the pointer dies then."""

        def go() -> Tuple[bool, int, int]:
            r = self._ep().alloc_host(size)
            return True, self._add(r), r.ptr

        return self._call("alloc_host", (False, 0, 0), go)

    def regv(self, ptrs: Sequence[int], sizes: Sequence[int]) -> Tuple[bool, List[int]]:
        """``(ok, [mr_id])``; all or none are registered."""
        if len(ptrs) != len(sizes):
            raise FerryError("regv: ptrs and sizes must match")

        def go() -> Tuple[bool, List[int]]:
            ep = self._ep()
            ids: List[int] = []
            try:
                for p, n in zip(ptrs, sizes):
                    ids.append(self._add(ep.register(p, n)))
            except FerryError:
                for i in ids:
                    r = self._take(i)
                    if r is not None:
                        r.close()
                raise
            return True, ids

        return self._call("regv", (False, []), go)

    def dereg(self, mr_id: int) -> bool:
        """Deregisters ``mr_id``, waiting until no transfer uses it (then the
        memory may be freed)."""

        def go() -> bool:
            r = self._take(mr_id)
            if r is None:
                raise _Failed(f"unknown mr_id {mr_id}")
            r.close()
            return True

        return self._call("dereg", False, go)

    def _advertise_one(self, conn_id: Optional[int], mr_id: int, ptr: int, size: int) -> bytes:
        conn = None if conn_id is None else self._conn(conn_id)
        return self._mr(mr_id).advertise(ptr, size, conn)

    def advertise(self, *args: Any) -> Tuple[bool, bytes]:
        """``advertise(conn_id, mr_id, ptr, size)`` (the seed's 0.1 wheel: a
        key for that connection only) or ``advertise(mr_id, ptr, size)`` (its
        repository: a key any connected peer may use) -> ``(ok, 64 bytes)``."""
        if len(args) == 4:
            c, m, p, n = args
        elif len(args) == 3:
            c, (m, p, n) = None, args
        else:
            raise FerryError(
                f"advertise takes (conn_id, mr_id, ptr, size) or (mr_id, ptr, size), not {len(args)} arguments"
            )
        return self._call("advertise", (False, b""), lambda: (True, self._advertise_one(c, m, p, n)))

    def advertisev(self, *args: Any) -> Tuple[bool, List[bytes]]:
        """``advertisev(conn_id, mr_id_v, ptr_v, size_v, num_iovs)`` or
        ``advertisev(mr_id_v, ptr_v, size_v, num_iovs)`` -> ``(ok, [bytes])``."""
        if len(args) == 5:
            c, m, p, s, n = args
        elif len(args) == 4:
            c, (m, p, s, n) = None, args
        else:
            raise FerryError(
                f"advertisev takes ([conn_id,] mr_id_v, ptr_v, size_v, num_iovs), not {len(args)} arguments"
            )
        if not (len(m) == len(p) == len(s) == n):
            raise _len_mismatch("advertisev")
        return self._call(
            "advertisev",
            (False, [bytes(_REMOTE_LEN)] * n),
            lambda: (True, [self._advertise_one(c, m[i], p[i], s[i]) for i in range(n)]),
        )

    # ---- one-sided operations with registrations ---------------------------

    def write(self, conn_id: int, mr_id: int, ptr: int, size: int, meta: bytes) -> bool:
        return self._single("write", True, conn_id, mr_id, ptr, size, meta, True)[0]

    def read(self, conn_id: int, mr_id: int, ptr: int, size: int, meta: bytes) -> bool:
        return self._single("read", False, conn_id, mr_id, ptr, size, meta, True)[0]

    def write_async(self, conn_id: int, mr_id: int, ptr: int, size: int, meta: bytes) -> Tuple[bool, int]:
        return self._single("write_async", True, conn_id, mr_id, ptr, size, meta, False)

    def read_async(self, conn_id: int, mr_id: int, ptr: int, size: int, meta: bytes) -> Tuple[bool, int]:
        return self._single("read_async", False, conn_id, mr_id, ptr, size, meta, False)

    def writev(self, conn_id: int, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs: int) -> bool:
        return self._vector("writev", True, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs, True)[0]

    def readv(self, conn_id: int, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs: int) -> bool:
        return self._vector("readv", False, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs, True)[0]

    def writev_async(self, conn_id: int, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs: int) -> Tuple[bool, int]:
        return self._vector("writev_async", True, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs, False)

    def readv_async(self, conn_id: int, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs: int) -> Tuple[bool, int]:
        return self._vector("readv_async", False, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs, False)

    # ---- the IPC family (bare pointers) -------------------------------------

    def _advertise_ipc_all(self, conn_id: int, ptr_v: Sequence[int], size_v: Sequence[int]) -> List[bytes]:
        if len(ptr_v) != len(size_v):
            raise _Failed(f"{len(ptr_v)} pointers but {len(size_v)} sizes")
        conn = self._conn(conn_id)
        return [self._by_ptr(p, n).advertise_ipc(p, n, conn) for p, n in zip(ptr_v, size_v)]

    def advertise_ipc(self, conn_id: int, ptr: int, size: int) -> Tuple[bool, bytes]:
        """``(ok, bytes)``: a CUDA IPC window (136 bytes) of GPU memory; of
        host memory, an ordinary window (64 bytes) that the same calls move
        over shm or tcp."""
        return self._call("advertise_ipc", (False, b""), lambda: (True, self._advertise_ipc_all(conn_id, [ptr], [size])[0]))

    def advertisev_ipc(self, conn_id: int, ptr_v: Sequence[int], size_v: Sequence[int]) -> Tuple[bool, List[bytes]]:
        return self._call("advertisev_ipc", (False, []), lambda: (True, self._advertise_ipc_all(conn_id, ptr_v, size_v)))

    def write_ipc(self, conn_id: int, ptr: int, size: int, info: bytes) -> bool:
        return self._one("write_ipc", conn_id, True, ptr, size, info)

    def read_ipc(self, conn_id: int, ptr: int, size: int, info: bytes) -> bool:
        return self._one("read_ipc", conn_id, False, ptr, size, info)

    def _one(self, what: str, conn_id: int, write: bool, ptr: int, size: int, info: bytes) -> bool:
        """One blocking ``*_ipc`` op in one native call (no connection
        object or lists: the seed's hottest small call)."""
        try:
            r = self._by_ptr(ptr, size)
            win = info if type(info) is bytes else bytes(info)
            self._ep().run_one(conn_id, write, r, ptr, size, win)
            return True
        except (FerryError, _Failed) as e:
            return self._fail(what, e, False)

    def write_ipc_async(self, conn_id: int, ptr: int, size: int, info: bytes) -> Tuple[bool, int]:
        return self._ipc("write_ipc_async", True, conn_id, [ptr], [size], [info], False)

    def read_ipc_async(self, conn_id: int, ptr: int, size: int, info: bytes) -> Tuple[bool, int]:
        return self._ipc("read_ipc_async", False, conn_id, [ptr], [size], [info], False)

    def writev_ipc(self, conn_id: int, ptr_v, size_v, info_v) -> bool:
        return self._ipc("writev_ipc", True, conn_id, ptr_v, size_v, info_v, True)[0]

    def readv_ipc(self, conn_id: int, ptr_v, size_v, info_v) -> bool:
        return self._ipc("readv_ipc", False, conn_id, ptr_v, size_v, info_v, True)[0]

    def writev_ipc_async(self, conn_id: int, ptr_v, size_v, info_v) -> Tuple[bool, int]:
        return self._ipc("writev_ipc_async", True, conn_id, ptr_v, size_v, info_v, False)

    def readv_ipc_async(self, conn_id: int, ptr_v, size_v, info_v) -> Tuple[bool, int]:
        return self._ipc("readv_ipc_async", False, conn_id, ptr_v, size_v, info_v, False)

    # ---- two-sided: send / recv ---------------------------------------------

    def _msg(self, what: str, send: bool, conn_id: int, pieces: Callable[[], List[Tuple[_native.Region, int, int]]], blocking: bool) -> Tuple[bool, int]:
        """Posts one message per piece (a send, or a receive buffer),
        matched in order per connection; waits for all (``blocking``:
        ``(ok, 0)``) or files them under one id (``(ok, transfer_id)``)."""
        try:
            conn = self._conn(conn_id)
            ps = pieces()
            if blocking and len(ps) == 1:
                # Posted and waited in one native call (one GIL release).
                r, p, n = ps[0]
                conn.exchange(send, r, p, n)
                return True, 0
            ms = [conn.send(r, p, n) if send else conn.recv(r, p, n) for r, p, n in ps]
        except (FerryError, _Failed) as e:
            return self._fail(what, e, (False, 0))
        if not blocking:
            return True, self._keep(ms[0] if len(ms) == 1 else _Group(ms))
        try:
            for m in ms:
                m.wait()
        except FerryError as e:
            return self._fail(what, e, (False, 0))
        return True, 0

    def _msgv(self, what: str, send: bool, conn_id: int, mr_id_v: Sequence[int], ptr_v: Sequence[int], size_v: Sequence[int], num_iovs: int, blocking: bool) -> Tuple[bool, int]:
        if not (len(mr_id_v) == len(ptr_v) == len(size_v) == num_iovs):
            return self._fail(what, _len_mismatch(what), (False, 0))
        return self._msg(what, send, conn_id, lambda: [(self._mr(m), p, n) for m, p, n in zip(mr_id_v, ptr_v, size_v)], blocking)

    def send(self, conn_id: int, mr_id: int, ptr: int, size: int) -> bool:
        """Sends ``size`` bytes at ``ptr`` (inside ``mr_id``) as one message:
        it fills the peer's next ``recv`` on this connection. Blocks until
        the peer took it."""
        return self._msg("send", True, conn_id, lambda: [(self._mr(mr_id), ptr, size)], True)[0]

    def recv(self, conn_id: int, mr_id: int, ptr: int, size: int) -> bool:
        """Receives the next message on this connection into ``ptr`` (at
        most ``size`` bytes, cut to the registration's end). A longer
        message fails here and at the sender."""
        return self._msg("recv", False, conn_id, lambda: [(self._mr(mr_id), ptr, size)], True)[0]

    def send_async(self, conn_id: int, mr_id: int, ptr: int, size: int) -> Tuple[bool, int]:
        return self._msg("send_async", True, conn_id, lambda: [(self._mr(mr_id), ptr, size)], False)

    def recv_async(self, conn_id: int, mr_id: int, ptr: int, size: int) -> Tuple[bool, int]:
        return self._msg("recv_async", False, conn_id, lambda: [(self._mr(mr_id), ptr, size)], False)

    def sendv(self, conn_id: int, mr_id_v: Sequence[int], ptr_v: Sequence[int], size_v: Sequence[int], num_iovs: int) -> bool:
        """One message per piece, in order (the seed's ``sendv``)."""
        return self._msgv("sendv", True, conn_id, mr_id_v, ptr_v, size_v, num_iovs, True)[0]

    def recvv(self, conn_id: int, mr_id_v: Sequence[int], ptr_v: Sequence[int], size_v: Sequence[int], num_iovs: int) -> bool:
        return self._msgv("recvv", False, conn_id, mr_id_v, ptr_v, size_v, num_iovs, True)[0]

    def sendv_async(self, conn_id: int, mr_id_v: Sequence[int], ptr_v: Sequence[int], size_v: Sequence[int], num_iovs: int) -> Tuple[bool, int]:
        return self._msgv("sendv_async", True, conn_id, mr_id_v, ptr_v, size_v, num_iovs, False)

    def recvv_async(self, conn_id: int, mr_id_v: Sequence[int], ptr_v: Sequence[int], size_v: Sequence[int], num_iovs: int) -> Tuple[bool, int]:
        return self._msgv("recvv_async", False, conn_id, mr_id_v, ptr_v, size_v, num_iovs, False)

    def send_ipc(self, conn_id: int, ptr: int, size: int) -> bool:
        """The seed's ``send_ipc``: a bare pointer (its allocation is
        registered on first use); same semantics as ``send``."""
        return self._msg("send_ipc", True, conn_id, lambda: [(self._by_ptr(ptr, size), ptr, size)], True)[0]

    def recv_ipc(self, conn_id: int, ptr: int, size: int) -> bool:
        return self._msg("recv_ipc", False, conn_id, lambda: [(self._by_ptr(ptr, size), ptr, size)], True)[0]

    def send_ipc_async(self, conn_id: int, ptr: int, size: int) -> Tuple[bool, int]:
        return self._msg("send_ipc_async", True, conn_id, lambda: [(self._by_ptr(ptr, size), ptr, size)], False)

    def recv_ipc_async(self, conn_id: int, ptr: int, size: int) -> Tuple[bool, int]:
        return self._msg("recv_ipc_async", False, conn_id, lambda: [(self._by_ptr(ptr, size), ptr, size)], False)

    # ---- transfers by id ------------------------------------------------------

    def poll_async(self, transfer_id: int) -> Tuple[bool, bool]:
        """``(ok, done)``. A finished id is forgotten once reported; an
        unknown one gives ``(False, False)``, a failed transfer ``(False, True)``."""
        t = self._xfers.get(transfer_id)
        if t is None:
            return self._fail("poll_async", _Failed(f"unknown or already reported transfer id {transfer_id}"), (False, False))
        try:
            if not t.done():
                return True, False
        except FerryError as e:
            self._xfers.pop(transfer_id, None)
            return self._fail("poll_async", e, (False, True))
        self._xfers.pop(transfer_id, None)
        return True, True

    def wait(self, transfer_id: int, timeout_s: Optional[float] = None) -> bool:
        """ferry's: waits for a transfer id (GIL released, Ctrl-C
        interrupts) up to ``timeout_s`` (None: no limit); ``True`` when it
        succeeded. A transfer still running at the timeout keeps its id."""
        t = self._xfers.get(transfer_id)
        if t is None:
            return self._fail("wait", _Failed(f"unknown or already reported transfer id {transfer_id}"), False)
        try:
            ended = t.wait(timeout_s)
        except FerryError as e:
            self._xfers.pop(transfer_id, None)
            return self._fail("wait", e, False)
        if not ended:
            return self._fail("wait", _Failed(f"transfer not done after {int((timeout_s or 0) * 1000)} ms"), False)
        self._xfers.pop(transfer_id, None)
        return True

    # ---- tensors and descriptors ---------------------------------------------

    def register_memory(self, tensor_list: Sequence[Any]) -> List[XferDesc]:
        """Registers each tensor (anything with ``data_ptr()``, ``numel()``
        and ``element_size()``, or numpy's array interface) and returns its
        ``XferDesc``; a tensor that cannot be registered gets ``mr_id``
        ``UINT64_MAX`` (and the reason is logged)."""
        ep = self._ep_strict()
        out = []
        for t in tensor_list:
            ptr, size = _tensor_info(t)
            d = XferDesc()
            d.addr, d.size = ptr, size
            try:
                r = ep.register(ptr, size)
                dtype = getattr(t, "dtype", None)
                if dtype is not None:
                    # torch.bfloat16, numpy float16, ...: what the codec can
                    # pack (integer types are left as bytes).
                    r.set_dtype(str(dtype))
                d.mr_id = self._add(r)
                d.lkeys = d.rkeys = [r.rkey]
                info = r.advertise(ptr, size)
                if r.is_gpu:
                    info += r.advertise_ipc(ptr, size)
                d.info = list(info)
            except FerryError as e:
                d = self._fail("register_memory", e, d)
            out.append(d)
        return out

    def deregister_memory(self, desc_list: Sequence[XferDesc]) -> None:
        for d in desc_list:
            if d.mr_id != UINT64_MAX:
                self.dereg(d.mr_id)

    def get_serialized_descs(self, desc_list: Sequence[XferDesc]) -> bytes:
        return _native.serialize_descs(list(desc_list))

    def deserialize_descs(self, serialized_bytes: bytes) -> List[XferDesc]:
        return _native.deserialize_descs(bytes(serialized_bytes))

    def transfer(self, conn_id: int, op_name: str, local_desc_list: Sequence[XferDesc], remote_desc_list: Sequence[XferDesc]) -> Tuple[bool, int]:
        """``(ok, transfer_id)``: one operation over the pairs; to a
        same-host peer, GPU windows go by CUDA IPC."""
        if op_name not in ("read", "write"):
            raise FerryError(f"transfer: invalid op_name {op_name!r} (read or write)")
        if len(local_desc_list) != len(remote_desc_list):
            raise FerryError("transfer: local and remote descriptors must have the same size")

        def pieces() -> Tuple[list, list]:
            local_peer = self._conn(conn_id).is_local
            wins = []
            for d in remote_desc_list:
                i = bytes(d.info)
                if local_peer and len(i) == _REMOTE_LEN + _IPC_LEN:
                    wins.append(i[_REMOTE_LEN:])
                elif len(i) >= _REMOTE_LEN:
                    wins.append(i[:_REMOTE_LEN])
                else:
                    raise _Failed(
                        "remote descriptor carries no ferry window (was it made by ferry's register_memory?)"
                    )
            return [(self._mr(d.mr_id), d.addr, d.size) for d in local_desc_list], wins

        return self._run("transfer", conn_id, op_name == "write", pieces, False)

    # ---- notifications ---------------------------------------------------

    def send_notification(self, conn_id: int, msg: bytes) -> bool:
        """Sends a small message (at most 4096 bytes) to the peer's inbox."""
        return self._call("send_notification", False, lambda: self._conn(conn_id).notify(bytes(msg)) or True)

    def recv_notification(self, timeout_ms: int = -1) -> Tuple[bool, int, bytes]:
        """``(ok, conn_id, bytes)``: the next message from any peer; a
        negative timeout waits without limit."""
        t = None if timeout_ms < 0 else timeout_ms / 1000.0

        def go() -> Tuple[bool, int, bytes]:
            c, m = self._ep().recv_notification(t)
            return True, c, m

        return self._call("recv_notification", (False, 0, b""), go)


__all__ = [
    "Endpoint",
    "FerryError",
    "FloatType",
    "UINT64_MAX",
    "XferDesc",
    "XferHandle",
    "get_oob_ip",
    "kBFloat16",
    "kFloat16",
    "kFloat32",
    "kFloat8E4M3FN",
    "kFloat8E5M2",
    "kUndefined",
]
