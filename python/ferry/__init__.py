"""ferry: one-sided WRITE and READ between registered memory regions (host
or GPU) of this process, another process or another host.

Two APIs over one engine:

* ``ferry.p2p`` -- the seed's (UCCL P2P's) API, name for name: existing
  callers change ``from uccl import p2p`` to ``from ferry import p2p``.
* ``ferry.Endpoint`` -- a Pythonic one: context managers, exceptions,
  objects instead of integer ids, blocking and ``await``-able transfers,
  buffers from anything exposing the buffer protocol,
  ``__cuda_array_interface__``, ``__dlpack__`` or ``data_ptr()``.

The CUDA driver and libibverbs are loaded at run time: the package imports
and works (host memory, tcp, shared memory) where neither exists.
"""

from ._native import (
    Busy,
    ConnectionFailed,
    Disconnected,
    FerryError,
    InvalidArgument,
    PeerMisbehaved,
    PeerTimeout,
    RemoteRefused,
    WaitTimeout,
    get_oob_ip,
    shm_unavailable,
)
from ._api import Connection, Endpoint, Region, Transfer, Window
from ._buffers import Buffer, locate

__all__ = [
    "Buffer",
    "Busy",
    "Connection",
    "ConnectionFailed",
    "Disconnected",
    "Endpoint",
    "FerryError",
    "InvalidArgument",
    "PeerMisbehaved",
    "PeerTimeout",
    "RemoteRefused",
    "WaitTimeout",
    "Region",
    "Transfer",
    "Window",
    "get_oob_ip",
    "locate",
    "shm_unavailable",
]
