"""How long numpy takes to copy an array, by the distance between source and destination.

On AMD EPYC with glibc 2.36 (the development VM), ``memmove`` copies a few KiB and more with
``rep movsb``, which from 4 KiB to about 1 MiB runs ten times slower when the destination starts
1-31 bytes past the source modulo 4 KiB. Two arrays of one size that is a multiple of 4 KiB,
allocated one after the other on glibc's heap, are 16 bytes apart (a chunk header), so
``b[...] = a`` hits it by default; so can any copy into or out of gloo's arena.

    python benchmarks/copy_distance.py
    GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=4294967295 python benchmarks/copy_distance.py

The second form turns ``rep movsb`` off for the process (the tunable must be set before it
starts).
"""

from __future__ import annotations

import time

import numpy as np

SIZES = (4 << 10, 64 << 10, 256 << 10, 4 << 20)
DISTANCES = (0, 16, 32, 48, 64, 4096 - 16, 4096 + 16)


def _best_us(fn, calls: int = 1000, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    buffer = np.zeros(64 << 20, np.uint8)
    page = (-buffer.ctypes.data) % 4096
    print("bytes      " + "".join(f"{d:>10}" for d in DISTANCES) + "   (distance dst - src, us)")
    for nbytes in SIZES:
        src = buffer[page : page + nbytes]
        row = []
        for distance in DISTANCES:
            at = page + (32 << 20) + distance
            dst = buffer[at : at + nbytes]
            row.append(
                _best_us(lambda d=dst, s=src: np.copyto(d, s), max(10, (64 << 20) // nbytes // 8))
            )
        print(f"{nbytes:>9}  " + "".join(f"{t:>10.2f}" for t in row))
    a = np.ones(16384, np.float32)
    b = np.empty(16384, np.float32)
    distance = (b.ctypes.data - a.ctypes.data) % 4096
    took = _best_us(lambda: np.copyto(b, a))
    print(
        f"two 64 KiB arrays allocated one after the other: distance mod 4096 = {distance}, "
        f"b[...] = a: {took:.2f} us"
    )


if __name__ == "__main__":
    main()
