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
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

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

    def __init__(self, ep: "Endpoint", native: "_native.Region", buf: Buffer) -> None:
        self._ep = ep
        self._r = native
        self.buffer = buf

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def is_gpu(self) -> bool:
        return self._r.is_gpu

    def _span(self, offset: int, size: Optional[int]) -> Tuple[int, int]:
        """The absolute (pointer, size) of ``[offset, offset + size)``; the
        native region checks the range."""
        if size is None:
            size = self.nbytes - offset
        return self.ptr + offset, size

    def advertise(
        self, offset: int = 0, size: Optional[int] = None, conn: Optional["Connection"] = None
    ) -> Window:
        """A window on ``[offset, offset + size)``: usable by any connected
        peer until deregistration, or with ``conn`` by that peer only until
        the connection closes."""
        ptr, size = self._span(offset, size)
        return Window(self._r.advertise(ptr, size, None if conn is None else conn._c))

    def advertise_ipc(self, conn: "Connection", offset: int = 0, size: Optional[int] = None) -> Window:
        """A CUDA IPC window (GPU memory) for the same-host peer on ``conn``;
        for host memory, an ordinary window for it."""
        ptr, size = self._span(offset, size)
        return Window(self._r.advertise_ipc(ptr, size, conn._c))

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
        self._r.close()

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "gpu" if self.is_gpu else "host"
        state = " closed" if self._r.closed else ""
        return f"<ferry.Region {kind} {self.nbytes} bytes at {self.ptr:#x}{state}>"


class Transfer:
    """An operation in flight: ``done()``, ``wait(timeout)`` or ``await``."""

    __slots__ = ("_t", "_done", "_keep", "_ep")

    def __init__(self, native: "_native.Transfer", keep: Any, ep: Optional["Endpoint"] = None) -> None:
        self._t = native
        self._done = False
        self._keep = keep  # the buffers, alive while the transfer runs
        self._ep = ep

    def done(self) -> bool:
        """Whether it has ended; raises ``FerryError`` if it failed."""
        if not self._done and self._t.done():
            self._done = True
            self._keep = None
        return self._done

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until it ends (GIL released; Ctrl-C interrupts); raises
        ``FerryError`` if it failed or ``timeout`` seconds passed first."""
        if self._done:
            return
        if not self._t.wait(timeout):
            raise _native.WaitTimeout(f"transfer not done after {timeout} s")
        self._done = True
        self._keep = None

    async def _wait_async(self) -> None:
        if self.done():
            return
        # The endpoint's completion fd wakes the event loop when something
        # ends: no thread spins, no sleep loop polls.
        assert self._ep is not None
        fut = asyncio.get_running_loop().create_future()
        self._ep._wake_when_done(self, fut)
        await fut

    def __await__(self):
        return self._wait_async().__await__()

    def __repr__(self) -> str:
        return f"<ferry.Transfer {'done' if self._done else 'in flight'}>"


_Local = Union[Region, Tuple[Region, int, int]]


def _piece(p: _Local) -> Tuple[Region, int, int]:
    if isinstance(p, Region):
        return p, 0, p.nbytes
    r, off, size = p
    return r, off, size


class Connection:
    """A connection to one peer (tcp, or shared memory on this host)."""

    def __init__(self, ep: "Endpoint", native: "_native.Connection") -> None:
        self._ep = ep
        self._c = native

    @property
    def id(self) -> int:
        return self._c.id

    @property
    def peer(self) -> Optional[Tuple[str, str]]:
        """``("tcp", "ip:port")`` or ``("shm", peer endpoint id)``; None once closed."""
        return self._c.peer

    def _submit(self, write: bool, locals_: Sequence[_Local], windows: Sequence[Window]) -> Transfer:
        pieces = [_piece(p) for p in locals_]
        spans = [(r._r,) + r._span(o, s) for r, o, s in pieces]
        t = self._c.submit(write, spans, [bytes(w) for w in windows])
        return Transfer(t, pieces, self._ep)

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
        """Sends a small message (at most 4096 bytes) to the peer's inbox.
        Raises ``ferry.Busy`` when the connection already holds
        ``FERRY_NOTIFY_OUTBOX`` messages not yet sent (nothing was taken:
        try again); once it returns, the message arrives or the connection
        fails (later calls raise ``ferry.ConnectionFailed``)."""
        self._c.notify(bytes(message))

    def vouch(self, metadata: bytes) -> bool:
        """Whether the far end is the endpoint whose metadata this is (bytes
        you trust: loaded for a peer you know by name). For a connection the
        peer dialed, that endpoint is asked whether it dialed it to us: a
        claimant that copied another's endpoint id is not vouched for. That
        endpoint answers from its accept loop: it must ``listen()``.
        Raises ``ferry.FerryError`` when it cannot be asked (``WaitTimeout``
        when it does not answer within the connect timeout)."""
        return self._ep._n.vouch(self.id, bytes(metadata))

    def close(self) -> None:
        self._c.close()

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
        self._n = _native.Endpoint(gpu)
        # Awaited transfers and their futures, and the event loop watching
        # the completion fd for them (None: none is).
        self._waiting: List[Tuple["Transfer", "asyncio.Future[None]"]] = []
        self._watching: Optional[asyncio.AbstractEventLoop] = None

    def completion_fd(self) -> int:
        """A file descriptor that becomes readable when a transfer of this
        endpoint ends or a notification arrives; call
        ``ack_completions()`` once it is, then look at what ended. ``await
        transfer`` uses it (``loop.add_reader``): an awaiting program
        spends no CPU while nothing ends."""
        return self._n.completion_fd()

    def ack_completions(self) -> None:
        """Drains the completion fd (before looking at what ended)."""
        self._n.ack_completions()

    def metrics_text(self) -> str:
        """The endpoint's counters in the Prometheus text format (what a
        service serves as ``GET /metrics``)."""
        return self._n.metrics_text()

    def metrics(self) -> Dict[str, float]:
        """The endpoint's counters, keyed by sample as scraped: e.g.
        ``'ferry_ops_total{op="write",transport="tcp",result="ok"}'``
        (the README's "Watching it run" lists them)."""
        out: Dict[str, float] = {}
        for line in self._n.metrics_text().splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def _wake_when_done(self, t: "Transfer", fut: "asyncio.Future[None]") -> None:
        loop = fut.get_loop()
        self._waiting.append((t, fut))
        if self._watching is not loop:
            if self._watching is not None:
                self._watching.remove_reader(self.completion_fd())
            loop.add_reader(self.completion_fd(), self._on_completions)
            self._watching = loop
        # It may have ended before it was listed: look at it once now. No
        # ack here (that would swallow others' wakes): an end after this
        # look raises the fd, or finds it raised and not yet acknowledged.
        try:
            ended = t.done()
        except BaseException as e:  # noqa: BLE001 - the transfer's error, to its awaiter
            fut.set_exception(e)
            ended = True
        else:
            if ended:
                fut.set_result(None)
        if ended:
            self._waiting.pop()
            if not self._waiting:
                loop.remove_reader(self.completion_fd())
                self._watching = None

    def _on_completions(self) -> None:
        self.ack_completions()
        still = []
        for t, fut in self._waiting:
            if fut.done():  # cancelled
                continue
            try:
                if not t.done():
                    still.append((t, fut))
                    continue
            except BaseException as e:  # noqa: BLE001 - the transfer's error, to its awaiter
                fut.set_exception(e)
                continue
            fut.set_result(None)
        self._waiting = still
        if not still and self._watching is not None:
            self._watching.remove_reader(self.completion_fd())
            self._watching = None

    @property
    def metadata(self) -> bytes:
        """What a peer needs to connect: send it by any channel."""
        return self._n.metadata

    @property
    def id(self) -> int:
        return self._n.id

    def listen(self) -> None:
        """Accepts connections in the background from now on."""
        self._n.start_passive_accept()

    def connect(self, metadata: bytes) -> Connection:
        """Connects to the peer whose metadata this is (once: a second call
        gives the same connection); a same-host peer over shared memory."""
        return Connection(self, self._n.add_remote(bytes(metadata)))

    def accept(self, timeout: Optional[float] = None) -> Connection:
        """Waits for one incoming connection (Ctrl-C interrupts)."""
        conn, _peer = self._n.accept(timeout)
        return Connection(self, conn)

    def register(self, obj: Any, dtype: Any = None) -> Region:
        """Registers the memory of ``obj`` without copying it (see
        ``ferry.locate``); ``obj`` is kept alive by the region. Read-only
        memory (``bytes``, read-only arrays) is registered so that peers
        may only READ it. ``dtype`` (default: ``obj.dtype`` when it has one,
        e.g. ``torch.bfloat16`` or numpy's ``float16``; or a name: bf16,
        fp16, fp32, fp8, fp8-e5m2, bytes) says what the values are, so tcp
        transfers of them may be compressed losslessly (FERRY_COMPRESS);
        integer types move as bytes."""
        b = locate(obj)
        # Memory Python holds immutable (bytes, read-only arrays) is only
        # ever read by peers.
        n = self._n.register(b.ptr, b.nbytes, b.readonly)
        dtype = dtype if dtype is not None else getattr(obj, "dtype", None)
        if dtype is not None:
            n.set_dtype(str(dtype))
        return Region(self, n, b)

    def alloc(self, nbytes: int) -> Region:
        """``nbytes`` zeroed bytes of host memory owned by the engine and
        shared with same-host peers (their transfers are one memcpy);
        ``region.view()`` reads and writes them. Freed on ``close()``."""
        r = self._n.alloc_host(nbytes)
        return Region(self, r, Buffer(r.ptr, nbytes, False, False, None))

    def recv_notification(self, timeout: Optional[float] = None) -> Tuple[int, bytes]:
        """The next message from any peer: ``(connection id, bytes)``."""
        return self._n.recv_notification(timeout)

    def close(self) -> None:
        """Shuts the endpoint down; its regions and connections end."""
        self._n.close()

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._n).replace("ferry Endpoint", "ferry.Endpoint", 1)
