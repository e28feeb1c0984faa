"""The message header every gloo message starts with, and the codes inside it.

A header is 64 bytes (one cache line, so shared-memory rings stay aligned) and says which
collective the sender is running and at which step, so that a receiver can tell a peer that runs
a different collective, dtype or size from a slow one, and name both.
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = 0x504C  # "PL"
# magic, message type, collective kind, dtype code, reduce-op code, pad,
# channel (which group), tag, collective sequence number, element count, part, payload bytes,
# root (the group rank a broadcast, reduce, gather or scatter is rooted at; -1 for none)
HEADER = struct.Struct("<HBBBBHQqQQQQq")
HEADER_SIZE = 64
assert HEADER.size <= HEADER_SIZE

# message types
DATA = 1
BYE = 2  # the sender closed its group on purpose (destroy_process_group)
DOORBELL = 3  # wakes a peer sleeping on shared memory (socket only)

# collective kinds
SEND = 1
ALL_REDUCE = 2
BROADCAST = 3
REDUCE = 4
ALL_GATHER = 5
REDUCE_SCATTER = 6
ALL_TO_ALL = 7
GATHER = 8
SCATTER = 9
BARRIER = 10

KIND_NAMES = {
    SEND: "send",
    ALL_REDUCE: "all_reduce",
    BROADCAST: "broadcast",
    REDUCE: "reduce",
    ALL_GATHER: "all_gather",
    REDUCE_SCATTER: "reduce_scatter",
    ALL_TO_ALL: "all_to_all",
    GATHER: "gather",
    SCATTER: "scatter",
    BARRIER: "barrier",
}

#: The tag every collective message carries (user tags are >= 0).
COLLECTIVE_TAG = -1

_DTYPE_NAMES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
]
_DTYPE_CODES = {name: i + 1 for i, name in enumerate(_DTYPE_NAMES)}

_OP_NAMES = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"]


_dtype_cache: dict = {}


def dtype_code(dtype) -> int:
    code = _dtype_cache.get(dtype)
    if code is None:
        code = _dtype_cache[dtype] = _DTYPE_CODES.get(str(np.dtype(dtype)), 0)
    return code


def dtype_name(code: int) -> str:
    return _DTYPE_NAMES[code - 1] if 0 < code <= len(_DTYPE_NAMES) else f"dtype#{code}"


_op_cache: dict = {}


def op_code(op) -> int:
    if op is None:
        return 0
    code = _op_cache.get(op)
    if code is None:
        code = _op_cache[op] = _OP_NAMES.index(op.name) + 1
    return code


def op_name(code: int) -> str:
    return _OP_NAMES[code - 1] if 0 < code <= len(_OP_NAMES) else ""


def pack(
    kind: int,
    dtype: int,
    op: int,
    channel: int,
    tag: int,
    seq: int,
    count: int,
    part: int,
    nbytes: int,
    mtype: int = DATA,
    root: int = -1,
) -> bytes:
    raw = HEADER.pack(
        MAGIC, mtype, kind, dtype, op, 0, channel, tag, seq, count, part, nbytes, root
    )
    return raw + bytes(HEADER_SIZE - HEADER.size)


class Header:
    """A decoded header."""

    __slots__ = (
        "mtype",
        "kind",
        "dtype",
        "op",
        "channel",
        "tag",
        "seq",
        "count",
        "part",
        "nbytes",
        "root",
    )

    def __init__(self, raw) -> None:
        (
            magic,
            self.mtype,
            self.kind,
            self.dtype,
            self.op,
            _,
            self.channel,
            self.tag,
            self.seq,
            (self.count),
            self.part,
            self.nbytes,
            self.root,
        ) = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise ValueError(f"bad magic 0x{magic:04x}")


def describe(
    kind: int, dtype: int, op: int, count: int, tag: int = COLLECTIVE_TAG, root: int = -1
) -> str:
    """``all_reduce(float32, 1000 elements, op=SUM)``: what a rank called, for error messages."""
    parts = [dtype_name(dtype), f"{count} elements"]
    if op:
        parts.append(f"op={op_name(op)}")
    if root >= 0:
        parts.append(f"root={root}")
    if kind == SEND:
        parts.append(f"tag={tag}")
    return f"{KIND_NAMES.get(kind, f'kind#{kind}')}({', '.join(parts)})"
