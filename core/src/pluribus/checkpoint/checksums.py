"""CRC-32 per fixed-size block of a chunk's bytes (zlib's, which runs at memory speed and
releases the GIL). Blocks, not one sum per chunk, so that a rank reading a few rows of a large
chunk verifies exactly the bytes it reads, plus at most one block at each end."""

from __future__ import annotations

import zlib
from collections.abc import Sequence


def block_crcs(data: memoryview, block: int) -> list[int]:
    return [zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)]


def aligned(begin: int, end: int, block: int, total: int) -> tuple[int, int]:
    """The smallest block-aligned range (blocks of a ``total``-byte chunk) that holds
    ``[begin, end)``."""
    return begin - begin % block, min(-(-end // block) * block, total)


def first_bad_block(
    segments: Sequence[memoryview], start: int, block: int, expected: Sequence[int]
) -> int | None:
    """Check the blocks that ``segments`` (consecutive, together block-aligned, beginning at
    chunk byte ``start``) hold; the index of the first that disagrees, or None."""
    index = start // block
    crc, filled = 0, 0
    for segment in segments:
        pos = 0
        while pos < len(segment):
            take = min(block - filled, len(segment) - pos)
            crc = zlib.crc32(segment[pos : pos + take], crc)
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
