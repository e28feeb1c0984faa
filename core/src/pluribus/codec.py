"""The safe encoding of the object collectives: data, never code.

``broadcast_object`` and ``all_gather_object`` carry small Python values between ranks. Bytes
from the network must not be able to run code on the receiver, so by default they travel in this
encoding, not pickle. It holds None, bool, int, float, str, bytes, list, tuple, dict (any
encodable keys), numpy arrays and numpy scalars (any dtype without Python objects in it):
everything a training loop exchanges (shapes, names, losses, state dicts). Anything else is a
TypeError on the sending rank before anything is sent; pickle is there for it when asked for by
name (``pickle=True``), between ranks that trust each other.

Layout: ``MAGIC``, an 8-byte length, a JSON description of the value, then the raw bytes of its
arrays and bytes objects, which the description points into (offset, length), each starting at
a multiple of ``ALIGN``. ``encode_parts`` / ``decode_parts`` give the description and the raw
pieces separately, so that a transport can send arrays without copying them (``pluribus.rpc``),
and take an extension for values the caller adds (``{"ext": ...}``, the RPC's remote
references).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from .arrays import bfloat16_dtype, device_of

MAGIC = b"PLB1"
_LENGTH = struct.Struct("<Q")
_TAGS = ("tuple", "dict", "bytes", "array", "scalar", "ext")
#: Raw pieces start at multiples of this, so arrays decoded in place are aligned.
ALIGN = 64
_PADDING = bytes(ALIGN)
#: ``extension(value)``: the JSON body standing for a value of a type the codec does not know
#: (the RPC's remote references), or None to refuse it.
Extension = Callable[[Any], Any]


def encode(obj: Any, rank: int) -> bytes:
    """``obj`` as bytes; a TypeError naming the rank and the offending type for anything that
    is not plain data."""
    description, pieces = encode_parts(
        obj,
        f"rank {rank}",
        hint="the object collectives do not send by default (they carry None, bool, int, float, "
        "str, bytes, list, tuple, dict and numpy arrays, never code); convert it to those, or "
        "pass pickle=True if every rank trusts every other",
    )
    return b"".join([MAGIC, _LENGTH.pack(len(description)), description, *pieces])


def encode_parts(
    obj: Any, who: str, hint: str, extension: Extension | None = None, root: str = "the object"
) -> tuple[bytes, list[memoryview]]:
    """The JSON description of ``obj`` and the raw pieces it points into, in order: arrays as
    views of their own memory (no copy for a contiguous host array), each piece starting at a
    multiple of ``ALIGN``. A sender writes them out as they are (``socket.sendmsg``). ``who``
    starts the TypeError for anything that is not plain data, ``root`` names ``obj`` in it,
    ``hint`` ends it."""
    pieces: list[memoryview] = []
    offset = [0]

    def blob(data) -> list[int]:
        view = memoryview(data).cast("B")
        pad = -offset[0] % ALIGN
        if pad:
            pieces.append(memoryview(_PADDING)[:pad])
        start = offset[0] + pad
        pieces.append(view)
        offset[0] = start + view.nbytes
        return [start, view.nbytes]

    def walk(value: Any) -> Any:
        kind = type(value)
        if kind in _PLAIN:
            return value
        if kind is list:
            return [walk(v) for v in value]
        if kind is tuple:
            return {"tuple": [walk(v) for v in value]}
        if kind is dict:
            return {"dict": [[walk(k), walk(v)] for k, v in value.items()]}
        return walk_other(value)

    def walk_other(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, tuple):
            return {"tuple": [walk(v) for v in value]}
        if isinstance(value, dict):
            return {"dict": [[walk(k), walk(v)] for k, v in value.items()]}
        if isinstance(value, (bytes, bytearray, memoryview)):
            return {"bytes": blob(value)}
        if isinstance(value, (np.ndarray, np.generic)) or device_of(value) == "cuda":
            return _array_node(value, blob)
        if extension is not None:
            body = extension(value)
            if body is not None:
                return {"ext": body}
        raise _Refused(
            value, f"a {type(value).__module__}.{type(value).__qualname__}, which {hint}"
        )

    try:
        tree = walk(obj)
    except _Refused as refused:
        path = _path_to(obj, refused.value, root) or f"a value in {root}"
        raise TypeError(f"{who}: {path} is {refused.reason}") from None
    return json.dumps(tree).encode(), pieces


_PLAIN = frozenset((type(None), bool, int, float, str))


class _Refused(Exception):
    def __init__(self, value: Any, reason: str):
        self.value = value
        self.reason = reason


def _path_to(obj: Any, target: Any, path: str) -> str | None:
    """Where ``target`` sits in ``obj`` (for error messages only, so it may be slow)."""
    if obj is target:
        return path
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found = _path_to(v, target, f"{path}[{i}]")
            if found:
                return found
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found = _path_to(k, target, f"{path} key") or _path_to(v, target, f"{path}[{k!r}]")
            if found:
                return found
    return None


def _array_node(value: Any, blob) -> dict:
    on_gpu = device_of(value) == "cuda"
    if on_gpu:  # TCP carries host memory: one copy to the host, and back to the GPU at the end
        import cupy

        array = cupy.asnumpy(value)
    else:
        array = np.asarray(value)
    if array.dtype.hasobject:
        raise _Refused(
            value,
            "a numpy array of Python objects, which the safe encoding cannot carry; convert it, "
            "or pass pickle=True between trusted ranks",
        )
    data = blob(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    tag = "scalar" if isinstance(value, np.generic) else "array"
    return {
        tag: [_dtype_name(array.dtype), list(array.shape), *data, *(["cuda"] if on_gpu else [])]
    }


def decode(data: bytes, rank: int, sender: str) -> Any:
    """The value ``encode`` made. Malformed bytes are a ValueError naming the rank and the
    sender; no input can make this run code."""
    try:
        view = memoryview(data)
        if bytes(view[: len(MAGIC)]) != MAGIC:
            raise ValueError("wrong magic")
        (length,) = _LENGTH.unpack_from(view, len(MAGIC))
        start = len(MAGIC) + _LENGTH.size
        return decode_parts(view[start : start + length], view[start + length :])
    except (ValueError, TypeError, KeyError, IndexError, struct.error) as exc:
        hint = ""
        if data[:1] == b"\x80":
            hint = "; they look pickled: the sender passed pickle=True, so pass it on every rank"
        raise ValueError(
            f"rank {rank}: the object from {sender} is not in pluribus' safe encoding ({exc}){hint}"
        ) from None


def decode_parts(
    description: bytes | memoryview,
    heap: bytes | bytearray | memoryview,
    extension: Extension | None = None,
    copy: bool = True,
) -> Any:
    """The value ``encode_parts`` described, its pieces read from ``heap``. With ``copy=False``
    arrays are views of ``heap`` (which then must not be reused). ``extension(body)`` rebuilds
    the values an encoding extension stood for. Malformed input raises ValueError, TypeError,
    KeyError or IndexError; no input can make this run code."""
    heap = memoryview(heap)
    tree = json.loads(bytes(description))

    def piece(begin: int, size: int) -> memoryview:
        if not (isinstance(begin, int) and isinstance(size, int)):
            raise ValueError("a reference that is not a pair of integers")
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
        if tag == "ext":
            if extension is None:
                raise ValueError("an extension value where none is expected")
            return extension(body)
        name, shape, begin, size, *device = body
        dtype = _dtype(name)
        array = np.frombuffer(piece(begin, size), dtype=dtype).reshape(shape)
        if device == ["cuda"]:
            import cupy

            array = cupy.asarray(array)
        elif device:
            raise ValueError(f"unknown device {device!r}")
        elif copy or tag == "scalar":
            array = array.copy()
        return array[()] if tag == "scalar" else array

    value = build(tree)
    build = None  # a recursive closure is a cycle: left alone, ``heap`` lives until a GC pass
    return value


def _dtype_name(dtype: np.dtype) -> str:
    bfloat16 = bfloat16_dtype()  # None without ml_dtypes, which float64 == None calls equal
    return "bfloat16" if bfloat16 is not None and dtype == bfloat16 else dtype.str


#: The dtype names ``encode`` writes (``dtype.str``: byte order, kind, size, a datetime unit).
#: Nothing else reaches ``np.dtype``, whose string parser accepts far more than names.
_DTYPE_NAME = re.compile(r"[<>|=][biufcmMSUV][0-9]{1,5}(\[[0-9]*[a-zA-Z]{1,3}\])?")


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        dtype = bfloat16_dtype()
    elif isinstance(name, str) and _DTYPE_NAME.fullmatch(name):
        dtype = np.dtype(name)
    else:
        dtype = None
    if dtype is None or dtype.hasobject:
        raise ValueError(f"dtype {str(name)[:40]!r} cannot be received")
    return dtype
