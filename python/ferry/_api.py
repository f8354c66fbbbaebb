"""The Pythonic API: ``ferry.Endpoint`` and the objects it hands out.

    with ferry.Endpoint() as ep:
        region = ep.register(numpy.zeros(1 << 20, numpy.uint8))
        window = region.advertise()          # send bytes(window) to a peer
        ...
        conn = ep.connect(peer_metadata)
        conn.write(src_region, peer_window)                  # blocking
        await conn.write_async(src_region, peer_window)      # asyncio
        t = conn.read_async(dst_region, peer_window); t.wait()

Errors raise ``ferry.FerryError`` with the reason. Blocking calls release
the GIL and a Ctrl-C interrupts them (``KeyboardInterrupt``); the
operation itself runs on to its end.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable, Optional, Sequence, Tuple, Union

from . import _native
from ._buffers import Buffer, locate

__all__ = ["Connection", "Endpoint", "Region", "Transfer", "Window"]

_REMOTE_LEN = _native.REMOTE_BUF_LEN
_IPC_LEN = _native.IPC_BUF_LEN


class Window:
    """A peer's advertised byte range: send ``bytes(window)`` to the peer
    that will WRITE into or READ from it; it rebuilds it with
    ``Window(data)``. 64 bytes for ordinary windows, 136 for CUDA IPC."""

    __slots__ = ("_b",)

    def __init__(self, data: Union[bytes, bytearray, memoryview]) -> None:
        b = bytes(data)
        if len(b) not in (_REMOTE_LEN, _IPC_LEN):
            raise ValueError(f"a window is {_REMOTE_LEN} or {_IPC_LEN} bytes, not {len(b)}")
        self._b = b

    def __bytes__(self) -> bytes:
        return self._b

    @property
    def is_ipc(self) -> bool:
        return len(self._b) == _IPC_LEN

    def __repr__(self) -> str:
        return f"<ferry.Window {'ipc' if self.is_ipc else 'remote'} {len(self._b)} bytes>"


class Region:
    """Registered memory. Peers may write into it or read from it while it
    is registered; ``close()`` (or leaving its ``with`` block) deregisters
    it, waiting until no transfer uses it."""

    def __init__(self, ep: "Endpoint", mr_id: int, buf: Buffer) -> None:
        self._ep = ep
        self.mr_id = mr_id
        self.buffer = buf

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def is_gpu(self) -> bool:
        return self.buffer.device

    def _span(self, offset: int, size: Optional[int]) -> Tuple[int, int]:
        if size is None:
            size = self.nbytes - offset
        if offset < 0 or size < 0 or offset + size > self.nbytes:
            raise _native.FerryError(
                f"[{offset}, +{size}) is outside the region of {self.nbytes} bytes"
            )
        return self.ptr + offset, size

    def advertise(
        self, offset: int = 0, size: Optional[int] = None, conn: Optional["Connection"] = None
    ) -> Window:
        """A window on ``[offset, offset + size)``: usable by any connected
        peer until deregistration, or with ``conn`` by that peer only until
        the connection closes."""
        ptr, size = self._span(offset, size)
        n = self._ep._n
        if conn is None:
            _, b = n.advertise(self.mr_id, ptr, size)
        else:
            _, b = n.advertise(conn.id, self.mr_id, ptr, size)
        return Window(b)

    def advertise_ipc(self, conn: "Connection", offset: int = 0, size: Optional[int] = None) -> Window:
        """A CUDA IPC window (GPU memory) for the same-host peer on ``conn``;
        for host memory, an ordinary window for it."""
        ptr, size = self._span(offset, size)
        _, b = self._ep._n.advertise_ipc(conn.id, ptr, size)
        return Window(b)

    def view(self) -> memoryview:
        """The bytes (host memory only), as a writable memoryview."""
        if self.is_gpu:
            raise _native.FerryError("GPU memory has no host view; copy it with your GPU library")
        keep = self.buffer.keep
        if isinstance(keep, tuple) and len(keep) == 3:
            return memoryview(keep[2]).cast("B")
        import ctypes

        return memoryview((ctypes.c_char * self.nbytes).from_address(self.ptr)).cast("B")

    def close(self) -> None:
        if self.mr_id is not None:
            mr, self.mr_id = self.mr_id, None
            self._ep._n.dereg(mr)

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "gpu" if self.is_gpu else "host"
        return f"<ferry.Region mr_id={self.mr_id} {kind} {self.nbytes} bytes at {self.ptr:#x}>"


class Transfer:
    """An operation in flight: ``done()``, ``wait(timeout)`` or ``await``."""

    __slots__ = ("_ep", "id", "_done", "_keep")

    def __init__(self, ep: "Endpoint", transfer_id: int, keep: Any) -> None:
        self._ep = ep
        self.id = transfer_id
        self._done = False
        self._keep = keep  # the regions, alive while the transfer runs

    def done(self) -> bool:
        """Whether it has ended; raises ``FerryError`` if it failed."""
        if not self._done:
            _, self._done = self._ep._n.poll_async(self.id)
            if self._done:
                self._keep = None
        return self._done

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until it ends (GIL released; Ctrl-C interrupts); raises
        ``FerryError`` if it failed or ``timeout`` seconds passed first."""
        if not self._done:
            self._ep._n.wait(self.id, timeout)
            self._done = True
            self._keep = None

    async def _wait_async(self) -> None:
        delay = 0.0
        while not self.done():
            await asyncio.sleep(delay)
            delay = min(delay * 2 or 20e-6, 1e-3)

    def __await__(self):
        return self._wait_async().__await__()

    def __repr__(self) -> str:
        return f"<ferry.Transfer id={self.id} {'done' if self._done else 'in flight'}>"


_Local = Union[Region, Tuple[Region, int, int]]


def _piece(p: _Local) -> Tuple[Region, int, int]:
    if isinstance(p, Region):
        return p, 0, p.nbytes
    r, off, size = p
    return r, off, size


class Connection:
    """A connection to one peer (tcp, or shared memory on this host)."""

    def __init__(self, ep: "Endpoint", conn_id: int) -> None:
        self._ep = ep
        self.id = conn_id

    @property
    def peer(self) -> Optional[Tuple[str, str]]:
        """``("tcp", "ip:port")`` or ``("shm", peer endpoint id)``; None once closed."""
        return self._ep._n.peer(self.id)

    def _submit(
        self, write: bool, locals_: Sequence[_Local], windows: Sequence[Window]
    ) -> Transfer:
        n = self._ep._n
        if len(locals_) != len(windows):
            raise _native.FerryError(f"{len(locals_)} local pieces but {len(windows)} windows")
        pieces = [_piece(p) for p in locals_]
        for r, _, _ in pieces:
            if r._ep is not self._ep:
                raise _native.FerryError(f"{r!r} belongs to another endpoint than this connection")
        spans = [r._span(o, s) for r, o, s in pieces]
        ws = [bytes(w) for w in windows]
        if all(len(w) == _REMOTE_LEN for w in ws):
            f = n.writev_async if write else n.readv_async
            _, tid = f(self.id, [r.mr_id for r, _, _ in pieces], [p for p, _ in spans],
                       [s for _, s in spans], ws, len(ws))
        else:
            f = n.writev_ipc_async if write else n.readv_ipc_async
            _, tid = f(self.id, [p for p, _ in spans], [s for _, s in spans], ws)
        return Transfer(self._ep, tid, pieces)

    def write_async(self, src: _Local, window: Window) -> Transfer:
        """Starts a WRITE of ``src`` (a region, or ``(region, offset, size)``)
        into the peer's ``window``."""
        return self._submit(True, [src], [window])

    def read_async(self, dst: _Local, window: Window) -> Transfer:
        """Starts a READ of the peer's ``window`` into ``dst``."""
        return self._submit(False, [dst], [window])

    def writev_async(self, srcs: Sequence[_Local], windows: Sequence[Window]) -> Transfer:
        return self._submit(True, srcs, windows)

    def readv_async(self, dsts: Sequence[_Local], windows: Sequence[Window]) -> Transfer:
        return self._submit(False, dsts, windows)

    def write(self, src: _Local, window: Window, timeout: Optional[float] = None) -> None:
        self.write_async(src, window).wait(timeout)

    def read(self, dst: _Local, window: Window, timeout: Optional[float] = None) -> None:
        self.read_async(dst, window).wait(timeout)

    def writev(self, srcs: Sequence[_Local], windows: Sequence[Window]) -> None:
        self.writev_async(srcs, windows).wait()

    def readv(self, dsts: Sequence[_Local], windows: Sequence[Window]) -> None:
        self.readv_async(dsts, windows).wait()

    def notify(self, message: bytes) -> None:
        """Sends a small message (at most 4096 bytes) to the peer's inbox."""
        self._ep._n.send_notification(self.id, bytes(message))

    def close(self) -> None:
        self._ep._n.remove_remote_endpoint(self.id)

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ferry.Connection {self.id:#x} {self.peer}>"


class Endpoint:
    """A ferry endpoint: a listener, the engine's shards, connections and
    registrations. ``gpu`` picks the GPU it serves (None: the first GPU
    memory registered picks it). Settings come from ``FERRY_*`` variables."""

    def __init__(self, gpu: Optional[int] = None) -> None:
        self._n = _native.Endpoint(gpu, strict=True)

    @property
    def metadata(self) -> bytes:
        """What a peer needs to connect: send it by any channel."""
        return self._n.get_metadata()

    @property
    def id(self) -> int:
        return self._n.endpoint_id

    def listen(self) -> None:
        """Accepts connections in the background from now on."""
        self._n.start_passive_accept()

    def connect(self, metadata: bytes) -> Connection:
        """Connects to the peer whose metadata this is (once: a second call
        gives the same connection); a same-host peer over shared memory."""
        _, cid = self._n.add_remote_endpoint(bytes(metadata))
        return Connection(self, cid)

    def accept(self) -> Connection:
        """Waits for one incoming connection (Ctrl-C interrupts)."""
        _, _, _, cid = self._n.accept()
        return Connection(self, cid)

    def register(self, obj: Any) -> Region:
        """Registers the memory of ``obj`` without copying it (see
        ``ferry.locate``); ``obj`` is kept alive by the region. Read-only
        memory (``bytes``, read-only arrays) is registered so that peers
        may only READ it."""
        b = locate(obj)
        # Memory Python holds immutable (bytes, read-only arrays) is only
        # ever read by peers.
        _, mr = self._n.reg(b.ptr, b.nbytes, readonly=b.readonly)
        return Region(self, mr, b)

    def alloc(self, nbytes: int) -> Region:
        """``nbytes`` zeroed bytes of host memory owned by the engine and
        shared with same-host peers (their transfers are one memcpy);
        ``region.view()`` reads and writes them. Freed on ``close()``."""
        _, mr, ptr = self._n.alloc_host(nbytes)
        return Region(self, mr, Buffer(ptr, nbytes, False, False, None))

    def recv_notification(self, timeout: Optional[float] = None) -> Tuple[int, bytes]:
        """The next message from any peer: ``(connection id, bytes)``."""
        ms = -1 if timeout is None else int(timeout * 1000)
        _, cid, msg = self._n.recv_notification(ms)
        return cid, msg

    def close(self) -> None:
        """Shuts the endpoint down; its regions and connections end."""
        self._n.close()

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._n).replace("ferry P2P Endpoint", "ferry.Endpoint", 1)
