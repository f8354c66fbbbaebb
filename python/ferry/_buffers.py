"""Where an object's bytes are, without copying them.

``locate(obj)`` understands, in this order: ``__cuda_array_interface__``
(cupy, torch CUDA tensors, numba), the buffer protocol (bytearray,
memoryview, numpy, mmap), numpy's ``__array_interface__``, ``data_ptr()``
with ``nbytes`` or ``numel() * element_size()`` (torch), and ``__dlpack__``
(any DLPack producer). Only C-contiguous memory is accepted: a transfer
moves one byte range.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["Buffer", "locate"]


@dataclass(frozen=True)
class Buffer:
    """A contiguous byte range: its address, length, whether it may be
    written, whether it is GPU memory, and what keeps it alive (and, for
    buffer-protocol objects, keeps them from being resized)."""

    ptr: int
    nbytes: int
    readonly: bool
    device: bool
    keep: Any = field(default=None, repr=False, compare=False)


def _contiguous(shape, strides, itemsize: int) -> bool:
    if strides is None:
        return True
    expect = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expect:
            return False
        expect *= dim
    return True


def _itemsize(typestr: str) -> int:
    return int(typestr[2:])


def _from_cai(obj, cai) -> Buffer:
    shape = tuple(cai["shape"])
    size = _itemsize(cai["typestr"])
    if not _contiguous(shape, cai.get("strides"), size):
        raise ValueError("ferry: GPU array is not C-contiguous")
    ptr, readonly = cai["data"]
    return Buffer(ptr or 0, math.prod(shape) * size, bool(readonly), True, obj)


def _from_buffer(obj) -> Optional[Buffer]:
    try:
        mv = memoryview(obj)
    except TypeError:
        return None
    if not mv.c_contiguous:
        raise ValueError("ferry: buffer is not C-contiguous")
    mv = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
    n = mv.nbytes
    if not mv.readonly:
        # from_buffer holds a buffer export for as long as the array lives,
        # so a bytearray cannot be resized (moved) under a registration.
        arr = (ctypes.c_char * n).from_buffer(mv)
        return Buffer(ctypes.addressof(arr), n, False, False, (obj, mv, arr))
    if isinstance(obj, bytes):
        p = ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value or 0
        return Buffer(p, n, True, False, obj)
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        return Buffer(ai["data"][0], n, True, False, (obj, mv))
    raise ValueError(f"ferry: cannot find the address of a read-only {type(obj).__name__}")


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3


def _from_dlpack(obj) -> Buffer:
    cap = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    # DLManagedTensor starts with its DLTensor. The capsule stays
    # unconsumed: its destructor gives the tensor back; `obj` owns the memory.
    t = _DLTensor.from_address(get(cap, b"dltensor"))
    if t.device.device_type not in (_DL_CPU, _DL_CUDA, _DL_CUDA_HOST):
        raise ValueError(f"ferry: DLPack device type {t.device.device_type} is not CPU or CUDA")
    shape = [t.shape[i] for i in range(t.ndim)]
    size = (t.dtype.bits * t.dtype.lanes + 7) // 8
    strides = None if not t.strides else [t.strides[i] * size for i in range(t.ndim)]
    if not _contiguous(shape, strides, size):
        raise ValueError("ferry: DLPack tensor is not C-contiguous")
    ptr = (t.data or 0) + t.byte_offset
    return Buffer(ptr, math.prod(shape) * size, False, t.device.device_type == _DL_CUDA, obj)


def locate(obj: Any) -> Buffer:
    """The contiguous bytes of ``obj`` (see the module docs)."""
    if isinstance(obj, Buffer):
        return obj
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cai(obj, cai)
    b = _from_buffer(obj)
    if b is not None:
        return b
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        shape = tuple(ai["shape"])
        size = _itemsize(ai["typestr"])
        if not _contiguous(shape, ai.get("strides"), size):
            raise ValueError("ferry: array is not C-contiguous")
        ptr, ro = ai["data"]
        return Buffer(ptr, math.prod(shape) * size, bool(ro), False, obj)
    if hasattr(obj, "data_ptr"):
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise ValueError("ferry: tensor is not contiguous")
        n = obj.nbytes if hasattr(obj, "nbytes") else obj.numel() * obj.element_size()
        dev = bool(getattr(obj, "is_cuda", False))
        return Buffer(obj.data_ptr(), int(n), False, dev, obj)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj)
    raise TypeError(
        f"ferry: {type(obj).__name__} exposes no buffer protocol, __cuda_array_interface__, "
        "__array_interface__, data_ptr() or __dlpack__"
    )
