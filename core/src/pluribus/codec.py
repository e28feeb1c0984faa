"""The safe encoding of the object collectives: data, never code.

``broadcast_object`` and ``all_gather_object`` carry small Python values between ranks. Bytes
from the network must not be able to run code on the receiver, so by default they travel in this
encoding, not pickle. It holds None, bool, int, float, str, bytes, list, tuple, dict (any
encodable keys), numpy arrays and numpy scalars (any dtype without Python objects in it):
everything a training loop exchanges (shapes, names, losses, state dicts). Anything else is a
TypeError on the sending rank before anything is sent; pickle is there for it when asked for by
name (``pickle=True``), between ranks that trust each other.

Layout: ``MAGIC``, an 8-byte length, a JSON description of the value, then the raw bytes of its
arrays and bytes objects, which the description points into (offset, length).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from .arrays import bfloat16_dtype

MAGIC = b"PLB1"
_LENGTH = struct.Struct("<Q")
_TAGS = ("tuple", "dict", "bytes", "array", "scalar")


def encode(obj: Any, rank: int) -> bytes:
    """``obj`` as bytes; a TypeError naming the rank and the offending type for anything that
    is not plain data."""
    blobs: list[bytes] = []
    offset = [0]

    def blob(data: bytes) -> list[int]:
        start = offset[0]
        blobs.append(data)
        offset[0] += len(data)
        return [start, len(data)]

    def walk(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"tuple": [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            return {
                "dict": [
                    [walk(k, f"{path} key"), walk(v, f"{path}[{k!r}]")] for k, v in value.items()
                ]
            }
        if isinstance(value, (bytes, bytearray, memoryview)):
            return {"bytes": blob(bytes(value))}
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            if array.dtype.hasobject:
                raise TypeError(
                    f"rank {rank}: {path} is a numpy array of Python objects, which the safe "
                    "encoding cannot carry; convert it, or pass pickle=True between trusted ranks"
                )
            data = blob(np.ascontiguousarray(array).tobytes())
            tag = "scalar" if isinstance(value, np.generic) else "array"
            return {tag: [_dtype_name(array.dtype), list(array.shape), *data]}
        raise TypeError(
            f"rank {rank}: {path} is a {type(value).__module__}.{type(value).__qualname__}, which "
            "the object collectives do not send by default (they carry None, bool, int, float, "
            "str, bytes, list, tuple, dict and numpy arrays, never code); convert it to those, "
            "or pass pickle=True if every rank trusts every other"
        )

    description = json.dumps(walk(obj, "the object")).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(description)), description, *blobs])


def decode(data: bytes, rank: int, sender: str) -> Any:
    """The value ``encode`` made. Malformed bytes are a ValueError naming the rank and the
    sender; no input can make this run code."""
    try:
        return _decode(memoryview(data))
    except (ValueError, TypeError, KeyError, IndexError, struct.error) as exc:
        hint = ""
        if data[:1] == b"\x80":
            hint = "; they look pickled: the sender passed pickle=True, so pass it on every rank"
        raise ValueError(
            f"rank {rank}: the object from {sender} is not in pluribus' safe encoding ({exc}){hint}"
        ) from None


def _decode(data: memoryview) -> Any:
    if bytes(data[: len(MAGIC)]) != MAGIC:
        raise ValueError("wrong magic")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    description = json.loads(bytes(data[start : start + length]))
    heap = data[start + length :]

    def piece(begin: int, size: int) -> memoryview:
        if not (0 <= begin and 0 <= size and begin + size <= len(heap)):
            raise ValueError("a reference past the end of the data")
        return heap[begin : begin + size]

    def build(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [build(v) for v in node]
        if not isinstance(node, dict) or len(node) != 1 or next(iter(node)) not in _TAGS:
            raise ValueError(f"unknown node {str(node)[:60]}")
        ((tag, body),) = node.items()
        if tag == "tuple":
            return tuple(build(v) for v in body)
        if tag == "dict":
            return {build(k): build(v) for k, v in body}
        if tag == "bytes":
            return bytes(piece(*body))
        name, shape, begin, size = body
        dtype = _dtype(name)
        array = np.frombuffer(piece(begin, size), dtype=dtype).reshape(shape).copy()
        return array[()] if tag == "scalar" else array

    return build(description)


def _dtype_name(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == bfloat16_dtype() else dtype.str


def _dtype(name: str) -> np.dtype:
    dtype = bfloat16_dtype() if name == "bfloat16" else np.dtype(name)
    if dtype is None or dtype.hasobject:
        raise ValueError(f"dtype {name!r} cannot be received")
    return dtype
