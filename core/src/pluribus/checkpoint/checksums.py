"""A checksum per fixed-size block of a chunk's bytes. Blocks, not one sum per chunk, so that a
rank reading a few rows of a large chunk verifies exactly the bytes it reads, plus at most one
block at each end.

CRC-32C (the ``crc32c`` package, in hardware on x86 and ARM: several times zlib's speed) when
it is installed, else zlib's CRC-32; the metadata names the one used, and a reader needs the
same one to verify.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from .errors import CheckpointError


def _crc32c() -> Callable | None:
    try:
        import crc32c
    except ImportError:
        return None
    return lambda data, value=0: crc32c.crc32c(data, value)


def preferred() -> str:
    return "crc32c" if _crc32c() is not None else "crc32"


def function(algorithm: str) -> Callable:
    """``f(data, running_value) -> value`` for the named algorithm."""
    if algorithm == "crc32":
        return zlib.crc32
    if algorithm == "crc32c":
        found = _crc32c()
        if found is None:
            raise CheckpointError(
                "this checkpoint's checksums are CRC-32C: pip install crc32c (or "
                '"pluribus[checkpoint]") to verify them, or load with verify=False'
            )
        return found
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r}; upgrade pluribus")


def block_sums(data: memoryview, block: int, algorithm: str) -> list[int]:
    f = function(algorithm)
    return [f(data[i : i + block]) for i in range(0, len(data), block)]


def aligned(begin: int, end: int, block: int, total: int) -> tuple[int, int]:
    """The smallest block-aligned range (blocks of a ``total``-byte chunk) that holds
    ``[begin, end)``."""
    return begin - begin % block, min(-(-end // block) * block, total)


def first_bad_block(
    segments: Sequence[memoryview], start: int, block: int, expected: Sequence[int], algorithm: str
) -> int | None:
    """Check the blocks that ``segments`` (consecutive, together block-aligned, beginning at
    chunk byte ``start``) hold; the index of the first that disagrees, or None."""
    f = function(algorithm)
    index = start // block
    crc, filled = 0, 0
    for segment in segments:
        pos = 0
        while pos < len(segment):
            take = min(block - filled, len(segment) - pos)
            crc = f(segment[pos : pos + take], crc)
            filled += take
            pos += take
            if filled == block:
                if index >= len(expected) or crc != expected[index]:
                    return index
                index, crc, filled = index + 1, 0, 0
    if filled:
        if index >= len(expected) or crc != expected[index]:
            return index
    return None
