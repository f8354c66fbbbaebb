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
  UCCL peer does not), the metadata bytes are the seed's.
"""

from ._native import Endpoint, FerryError, FloatType, UINT64_MAX, XferDesc, get_oob_ip

kUndefined = FloatType.kUndefined
kFloat16 = FloatType.kFloat16
kBFloat16 = FloatType.kBFloat16
kFloat32 = FloatType.kFloat32
kFloat8E4M3FN = FloatType.kFloat8E4M3FN
kFloat8E5M2 = FloatType.kFloat8E5M2


class XferHandle:
    """The seed's record of a started transfer (conn_id, op_name, transfer_id)."""

    __slots__ = ("conn_id", "op_name", "transfer_id")

    def __init__(self, conn_id: int, op_name: str, transfer_id: int) -> None:
        self.conn_id = conn_id
        self.op_name = op_name
        self.transfer_id = transfer_id

    def __repr__(self) -> str:
        return f"<XferHandle conn_id={self.conn_id} op={self.op_name} id={self.transfer_id}>"


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
