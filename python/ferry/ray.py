"""ferry as a Ray tensor transport (Ray Direct Transport, Ray >= 2.60).

    import ferry.ray
    ferry.ray.register()          # in the driver, before the actors are made

    @ray.remote
    class Producer:
        @ray.method(tensor_transport="FERRY")
        def weights(self):
            return {"w": torch.ones(1 << 20)}

    ref = ray.put(tensor, _tensor_transport="FERRY")

One-sided: the source actor registers the tensors of an object when Ray
makes it (through ferry's registration cache: a tensor in two objects is
registered once) and hands out ferry windows with its endpoint's metadata;
the receiver connects to it once (connections are kept per peer) and READs
every tensor of the object in one request into tensors it allocates (or the
target buffers Ray passes). The source takes no part in the transfer. Same
host: shared memory for host memory, CUDA for GPU memory; other hosts: tcp
(RDMA verbs where a NIC is). When Ray frees the object the registrations
end; a transfer that fails (the source actor died, its host went) raises
``RayDirectTransportError`` with ferry's reason, never hangs: every ferry
op has a deadline (``FERRY_OP_TIMEOUT_MS``) and a silent peer is noticed
(``FERRY_LIVENESS_MS``).

Tensors are ``torch.Tensor`` (host or CUDA) when torch is installed, else
``numpy.ndarray`` (``register(data_type=...)`` picks). One ferry endpoint
per process, made at first use; the ``FERRY_*`` settings apply to it. All
tensors of one object must be contiguous and on one device type; CUDA
tensors of one process on one GPU (the endpoint serves one).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ._api import Connection, Endpoint, Region, Transfer, Window
from ._native import ConnectionFailed, FerryError, WaitTimeout

try:
    from ray.experimental.rdt.tensor_transport_manager import (
        CommunicatorMetadata,
        FetchRequest,
        TensorTransportManager,
        TensorTransportMetadata,
    )
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "ferry.ray needs Ray with custom tensor transports (ray>=2.60: "
        "ray.experimental.rdt.tensor_transport_manager); pip install 'ray>=2.60'"
    ) from e

__all__ = [
    "TRANSPORT",
    "FerryCommunicatorMetadata",
    "FerryFetchRequest",
    "FerryTensorTransport",
    "FerryTransportMetadata",
    "register",
    "stats",
]

#: The name to pass as ``tensor_transport=`` / ``_tensor_transport=``.
TRANSPORT = "FERRY"

#: Connections kept to source actors; past it the least recently used one
#: with nothing in flight is closed.
MAX_PEERS = 1024

#: Object ids of aborts remembered (an abort may come before the fetch).
_MAX_ABORTS = 4096

#: Actors remembered to have ferry importable.
_MAX_ACTORS = 4096

#: How often a waiting fetch looks whether it was aborted, in seconds.
_ABORT_POLL_S = 0.05

#: Fresh host buffers at least this long are backed by huge pages (see
#: ``_advise_huge_pages``).
_HUGE_PAGES_MIN = 4 << 20
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc: Any = None


# The instance Ray made in this process (for ``stats``).
_instance: Optional["FerryTensorTransport"] = None


def register(data_type: Any = None) -> None:
    """Registers the ``"FERRY"`` tensor transport with Ray. Call it in the
    driver before making the actors that use it (Ray hands it to them).
    ``data_type``: the tensor type Ray pulls out of returned values
    (default ``torch.Tensor`` when torch imports, else ``numpy.ndarray``).
    A second call is a no-op."""
    from ray.experimental import register_tensor_transport
    from ray.experimental.rdt import util

    known = getattr(util, "transport_manager_info", {}).get(TRANSPORT)
    if known is not None and known.transport_manager_class is FerryTensorTransport:
        return

    if data_type is None:
        try:
            import torch

            data_type = torch.Tensor
        except ImportError:
            import numpy

            data_type = numpy.ndarray
    register_tensor_transport(TRANSPORT, ["cpu", "cuda"], FerryTensorTransport, data_type)


@dataclass
class FerryCommunicatorMetadata(CommunicatorMetadata):
    """Nothing: the receiver finds the source by the object's metadata."""


@dataclass
class FerryTransportMetadata(TensorTransportMetadata):
    """What the receiver needs: the source endpoint's metadata and one
    window per tensor (None for a tensor of no bytes)."""

    ferry_endpoint: Optional[bytes] = None
    ferry_windows: Optional[List[Optional[bytes]]] = None

    # Ray keys tables by these objects: identity, not field equality.
    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass
class FerryFetchRequest(FetchRequest):
    """A READ in flight into ``tensors``. Dropping it unwaited still ends
    the registrations (after the READ ends: memory is never freed under a
    transfer)."""

    transfer: Optional[Transfer] = None
    regions: List[Region] = field(default_factory=list)
    peer: Optional[bytes] = None
    transport: Optional["FerryTensorTransport"] = None

    def _release(self) -> None:
        # The transfer holds its pieces' registrations until dropped: let it
        # go first, or each close waits (sleeping) for it.
        self.transfer = None
        regions, self.regions = self.regions, []
        for r in regions:
            try:
                r.close()  # waits until no transfer uses it
            except FerryError:
                pass
        if self.transport is not None and self.peer is not None:
            self.transport._unbusy(self.peer)
            self.peer = None

    def __del__(self) -> None:
        self._release()


# -- tensors: torch or numpy, without importing either unless used -------------


def _is_torch(t: Any) -> bool:
    return type(t).__module__.startswith("torch")


def _nbytes(t: Any) -> int:
    if _is_torch(t):
        return t.numel() * t.element_size()
    return int(t.nbytes)


def _device_type(t: Any) -> str:
    return t.device.type if _is_torch(t) else "cpu"


def _contiguous(t: Any) -> bool:
    return t.is_contiguous() if _is_torch(t) else bool(t.flags.c_contiguous)


def _registrable(t: Any) -> Any:
    # A tensor that requires grad has no __cuda_array_interface__; the
    # detached one shares its memory.
    return t.detach() if _is_torch(t) else t


#: Where each tensor of a fetched object starts in its one allocation.
_ALIGN = 256


def _advise_huge_pages(ptr: int, nbytes: int) -> None:
    """Asks for transparent huge pages under the 2 MiB-aligned inside of a
    fresh host buffer of ours (an advice: where the kernel has them off,
    or refuses, nothing changes).

    The source actor writes the object into it from its own process
    (``process_vm_writev``), faulting in every page as it goes. numpy
    gives large arrays this advice itself; torch's allocator does not,
    and 4 KiB pages made a 64 MiB fetch into a fresh tensor 36 ms on the
    2-core VM against 10 ms into a numpy array, 14 ms with the advice."""
    global _libc
    start = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
    end = (ptr + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def _alloc_object(tensor_meta: List[Tuple[Any, Any]], device: Optional[str]) -> Tuple[Any, List[int], List[Any]]:
    """One byte buffer for all tensors of an object (None when they hold
    no bytes), each tensor's offset in it, and the tensors: views of it."""
    offsets, total = [], 0
    for shape, dtype in tensor_meta:
        offsets.append(total)
        total += -(-_nbytes_of(shape, dtype) // _ALIGN) * _ALIGN
    if not tensor_meta:
        return None, [], []
    numpy_kind = type(tensor_meta[0][1]).__module__.startswith("numpy")
    if numpy_kind:
        import numpy

        buf = numpy.empty(max(total, 1), dtype=numpy.uint8)
    else:
        import torch

        buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device or "cpu")
        if buf.device.type == "cpu" and total >= _HUGE_PAGES_MIN:
            _advise_huge_pages(buf.data_ptr(), total)
    tensors = [
        buf[off : off + _nbytes_of(shape, dtype)].view(dtype).reshape(tuple(shape))
        for (shape, dtype), off in zip(tensor_meta, offsets)
    ]
    return (buf if total else None), offsets, tensors


class FerryTensorTransport(TensorTransportManager):
    """The ``"FERRY"`` transport (one instance per process, made by Ray)."""

    def __init__(self) -> None:
        global _instance
        _instance = self
        self._lock = threading.RLock()
        self._ep: Optional[Endpoint] = None
        # Source side: each live object's registrations.
        self._objects: Dict[str, List[Region]] = {}
        # Receiver side: connections by peer metadata (LRU), and how many
        # fetches each has in flight.
        self._peers: "collections.OrderedDict[bytes, Connection]" = collections.OrderedDict()
        self._busy: Dict[bytes, int] = {}
        self._aborted: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        # Actors known to have ferry (LRU).
        self._actors_with_ferry: "collections.OrderedDict[Any, None]" = collections.OrderedDict()

    # -- what Ray asks of every transport --------------------------------------

    def tensor_transport_backend(self) -> str:
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        # Ray asks before every transport call; the answer is a round trip
        # to the actor (~2 ms): a yes is kept per actor.
        key = getattr(actor, "_actor_id", None)
        with self._lock:
            if key is not None and key in self._actors_with_ferry:
                self._actors_with_ferry.move_to_end(key)
                return True
        has = self._ask_actor(actor)
        if has and key is not None:
            with self._lock:
                self._actors_with_ferry[key] = None
                while len(self._actors_with_ferry) > _MAX_ACTORS:
                    self._actors_with_ferry.popitem(last=False)
        return has

    @staticmethod
    def _ask_actor(actor: Any) -> bool:
        import ray

        def __ray_actor_has_ferry__(self: Any) -> bool:
            try:
                import ferry.ray  # noqa: F401

                return True
            except Exception:
                return False

        return bool(
            ray.get(
                actor.__ray_call__.options(concurrency_group="_ray_system").remote(
                    __ray_actor_has_ferry__
                )
            )
        )

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: Optional[str] = None
    ) -> FerryCommunicatorMetadata:
        return FerryCommunicatorMetadata()

    # -- source side ------------------------------------------------------------

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: List[Any]
    ) -> FerryTransportMetadata:
        tensor_meta: List[Tuple[Any, Any]] = []
        if not rdt_object:
            return FerryTransportMetadata(tensor_meta=tensor_meta, tensor_device=None)
        device = _device_type(rdt_object[0])
        for i, t in enumerate(rdt_object):
            if _device_type(t) != device:
                raise ValueError(
                    f"ferry.ray: all tensors of an object must be on one device type: "
                    f"tensor 0 is on {device}, tensor {i} on {_device_type(t)}"
                )
            if not _contiguous(t):
                raise ValueError(f"ferry.ray: tensor {i} of the object is not contiguous")
            tensor_meta.append((t.shape, t.dtype))
        if device == "cuda":
            import torch

            # The tensors' producers may still run on the GPU: a peer must
            # read what the task returned, not what was there before.
            for dev in {t.device for t in rdt_object}:
                torch.cuda.synchronize(dev)
        ep = self._endpoint()
        regions: List[Region] = []
        windows: List[Optional[bytes]] = []
        try:
            for t in rdt_object:
                if _nbytes(t) == 0:
                    windows.append(None)
                    continue
                r = ep.register(_registrable(t))
                regions.append(r)
                windows.append(bytes(r.advertise()))
        except BaseException:
            for r in regions:
                r.close()
            raise
        with self._lock:
            old = self._objects.pop(obj_id, None)
            self._objects[obj_id] = regions
        for r in old or []:
            r.close()
        return FerryTransportMetadata(
            tensor_meta=tensor_meta,
            tensor_device=device,
            ferry_endpoint=ep.metadata,
            ferry_windows=windows,
        )

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: List[Any]
    ) -> None:
        with self._lock:
            regions = self._objects.pop(obj_id, None)
            self._aborted.pop(obj_id, None)
        for r in regions or []:
            r.close()  # a peer's READ in flight ends first

    def send_multiple_tensors(
        self,
        tensors: List[Any],
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
    ) -> None:
        raise NotImplementedError("ferry.ray is one-sided: the receiver READs, the source sends nothing")

    # -- receiver side ------------------------------------------------------------

    def fetch_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: Optional[List[Any]] = None,
    ) -> FerryFetchRequest:
        meta = tensor_transport_metadata
        if not isinstance(meta, FerryTransportMetadata):
            raise TypeError(f"ferry.ray: metadata of another transport ({type(meta).__name__})")
        self._raise_if_aborted(obj_id)
        if target_buffers:
            tensors = list(target_buffers)
            if len(tensors) != len(meta.tensor_meta):
                raise ValueError(
                    f"ferry.ray: {len(tensors)} target buffers for an object of "
                    f"{len(meta.tensor_meta)} tensors"
                )
            block, offsets = None, []
        else:
            # One allocation for the whole object, the tensors views of it:
            # one registration per fetch, whatever the tensor count.
            buf, offsets, tensors = _alloc_object(meta.tensor_meta, meta.tensor_device)
            block = self._endpoint().register(buf) if buf is not None else None
        req = FerryFetchRequest(obj_id=obj_id, tensors=tensors, transport=self)
        if block is not None:
            req.regions.append(block)
        try:
            pieces, wins = self._pieces(meta, tensors, block, offsets, req)
        except BaseException:
            req._release()
            raise
        if not pieces:
            return req
        peer = bytes(meta.ferry_endpoint or b"")
        try:
            conn = self._connect(peer)
            req.peer = peer
            req.transfer = conn.readv_async(pieces, wins)
        except FerryError as e:
            self._forget_peer(peer, e)
            req._release()
            raise _transport_error(obj_id, e) from None
        return req

    def _pieces(
        self, meta: FerryTransportMetadata, tensors: List[Any], block: Optional[Region], offsets: List[int], req: FerryFetchRequest
    ) -> Tuple[List[Any], List[Window]]:
        """The READ's local pieces and the source's windows, checked against
        the object's metadata (target buffers registered into ``req``)."""
        windows = meta.ferry_windows or []
        if len(windows) != len(tensors):
            raise ValueError(
                f"ferry.ray: the object's metadata has {len(windows)} windows for {len(tensors)} tensors"
            )
        pieces: List[Any] = []
        wins: List[Window] = []
        for i, (t, w) in enumerate(zip(tensors, windows)):
            shape, dtype = meta.tensor_meta[i]
            want = _nbytes_of(shape, dtype)
            if _nbytes(t) != want:
                raise ValueError(
                    f"ferry.ray: target buffer {i} holds {_nbytes(t)} bytes, the tensor {want}"
                )
            if w is None or want == 0:
                continue
            if block is not None:
                pieces.append((block, offsets[i], want))
            else:
                if not _contiguous(t):
                    raise ValueError(f"ferry.ray: target buffer {i} is not contiguous")
                req.regions.append(self._endpoint().register(_registrable(t)))
                pieces.append(req.regions[-1])
            wins.append(Window(w))
        return pieces, wins

    def wait_fetch_complete(self, fetch_request: FetchRequest, timeout: float = -1) -> List[Any]:
        req = fetch_request
        if not isinstance(req, FerryFetchRequest) or req.transfer is None:
            return req.tensors
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        try:
            while True:
                left = _ABORT_POLL_S
                if deadline is not None:
                    left = min(left, max(0.0, deadline - time.monotonic()))
                try:
                    req.transfer.wait(left)
                    break
                except WaitTimeout:
                    pass
                self._raise_if_aborted(req.obj_id)
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"ferry.ray: object {req.obj_id} not fetched after {timeout} s")
        except TimeoutError:
            # Still in flight: the request stays whole for a later wait.
            raise
        except FerryError as e:
            if req.peer is not None:
                self._forget_peer(req.peer, e)
            req._release()
            raise _transport_error(req.obj_id, e) from None
        except BaseException:
            req._release()
            raise
        req._release()
        return req.tensors

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: Optional[List[Any]] = None,
    ) -> List[Any]:
        req = self.fetch_multiple_tensors(
            obj_id, tensor_transport_metadata, communicator_metadata, target_buffers
        )
        return self.wait_fetch_complete(req)

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        with self._lock:
            self._aborted[obj_id] = None
            while len(self._aborted) > _MAX_ABORTS:
                self._aborted.popitem(last=False)

    # -- this process's endpoint and peers ----------------------------------------

    def _endpoint(self) -> Endpoint:
        with self._lock:
            if self._ep is None:
                ep = Endpoint()
                ep.listen()
                atexit.register(ep.close)
                self._ep = ep
            return self._ep

    def _connect(self, peer: bytes) -> Connection:
        with self._lock:
            conn = self._peers.get(peer)
            if conn is not None:
                self._peers.move_to_end(peer)
            else:
                conn = self._endpoint().connect(peer)
                self._peers[peer] = conn
                self._evict()
            self._busy[peer] = self._busy.get(peer, 0) + 1
            return conn

    def _unbusy(self, peer: bytes) -> None:
        with self._lock:
            n = self._busy.get(peer, 0) - 1
            if n > 0:
                self._busy[peer] = n
            else:
                self._busy.pop(peer, None)

    def _evict(self) -> None:
        # Called with the lock held.
        for peer in list(self._peers):
            if len(self._peers) <= MAX_PEERS:
                return
            if self._busy.get(peer):
                continue
            self._peers.pop(peer).close()

    def _forget_peer(self, peer: bytes, why: FerryError) -> None:
        """A failed connection is not used again: the next fetch from that
        peer connects afresh (or fails at once if it is gone)."""
        if not isinstance(why, ConnectionFailed):
            return
        with self._lock:
            conn = self._peers.pop(peer, None)
        if conn is not None:
            try:
                conn.close()
            except FerryError:
                pass

    def _raise_if_aborted(self, obj_id: str) -> None:
        with self._lock:
            if obj_id not in self._aborted:
                return
            del self._aborted[obj_id]
        raise RuntimeError(f"ferry.ray: the transfer of object {obj_id} was aborted")

    def _stats(self) -> Dict[str, Any]:
        with self._lock:
            out: Dict[str, Any] = {
                "objects": len(self._objects),
                "registered_tensors": sum(len(v) for v in self._objects.values()),
                "peers": len(self._peers),
            }
            ep = self._ep
        out["metrics"] = ep.metrics() if ep is not None else {}
        return out


def _nbytes_of(shape: Any, dtype: Any) -> int:
    n = int(dtype.itemsize)
    for d in shape:
        n *= int(d)
    return n


def _transport_error(obj_id: str, e: BaseException) -> BaseException:
    from ray.exceptions import RayDirectTransportError

    return RayDirectTransportError(
        f"The FERRY transfer failed for object id: {obj_id}. The source actor may have died "
        f"during the transfer. ferry said: {type(e).__name__}: {e}\n{traceback.format_exc()}"
    )


def stats() -> Dict[str, Any]:
    """This process's side of the transport: live objects it is the source
    of, their registered tensors, peers connected, and the endpoint's
    metrics (``Endpoint.metrics()``; all empty before first use)."""
    mgr = _instance
    if mgr is None:
        return {"objects": 0, "registered_tensors": 0, "peers": 0, "metrics": {}}
    return mgr._stats()
