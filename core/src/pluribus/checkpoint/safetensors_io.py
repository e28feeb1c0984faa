"""The safetensors file format, written and read here by byte range.

A file is an 8-byte little-endian header length, a JSON header (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``, padded with spaces to a multiple
of 8) and the tensors' bytes in C order. Writing it ourselves streams each array straight from
its memory to the file (no serialised copy), and reading it ourselves lets a rank fetch only the
rows it needs. Any safetensors reader (``safetensors.numpy.load_file``) opens the files.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

#: numpy dtype name -> safetensors dtype name (little-endian data in both)
DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
NUMPY_DTYPES = {v: k for k, v in DTYPES.items()}

#: the largest header any safetensors reader accepts (the format's own limit)
MAX_HEADER = 100_000_000


def numpy_dtype(name: str) -> np.dtype:
    """A numpy dtype from its name; bfloat16 comes from ml_dtypes (installed with the extras)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: where its bytes are, counted from the start of the file."""

    name: str
    dtype: str  # numpy name
    shape: tuple[int, ...]
    begin: int
    end: int


def encode_header(
    specs: Iterable[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict[str, str]
) -> bytes:
    """The length prefix and JSON header for tensors laid out back to back in ``specs`` order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {
            "dtype": DTYPES[dtype.name],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def as_bytes(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous host array, without a copy."""
    return memoryview(array.reshape(-1).view(np.uint8))


def write_file(
    path: str, tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str], after_each=None
) -> None:
    """Write host arrays (C-contiguous, little-endian) as one safetensors file, then fsync it.
    ``after_each()`` runs after each tensor's bytes are handed to the kernel."""
    head = encode_header(((n, a.dtype, a.shape) for n, a in tensors), metadata)
    with open(path, "wb") as f:
        f.write(head)
        for _, array in tensors:
            if array.nbytes:
                f.write(as_bytes(array))
            if after_each is not None:
                f.flush()
                after_each()
        f.flush()
        os.fsync(f.fileno())


def read_header(fd: int, path: str) -> tuple[dict[str, Entry], dict[str, str], int]:
    """The tensors of an open file, its ``__metadata__`` and its size; a damaged header raises
    ``ValueError`` naming the file."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise ValueError(f"{path}: {size} bytes, too short for a safetensors header")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER or 8 + length > size:
        raise ValueError(f"{path}: header length {length} does not fit the file of {size} bytes")
    try:
        header = json.loads(os.pread(fd, length, 8))
    except ValueError as e:
        raise ValueError(f"{path}: the safetensors header is not JSON ({e})") from None
    data_start = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        entries[name] = Entry(
            name,
            NUMPY_DTYPES[info["dtype"]],
            tuple(info["shape"]),
            data_start + begin,
            data_start + end,
        )
    return entries, header.get("__metadata__") or {}, size


def read_range(fd: int, begin: int, length: int, path: str) -> bytearray:
    """``length`` bytes at ``begin``; a short read (truncated file) raises naming the file."""
    buffer = bytearray(length)
    view = memoryview(buffer)
    done = 0
    while done < length:
        n = os.preadv(fd, [view[done:]], begin + done)
        if n == 0:
            raise ValueError(
                f"{path}: the file ends before byte {begin + length} (read {begin + done}); "
                "it was truncated"
            )
        done += n
    return buffer
