"""Random values that depend on the element, not on the layout: element ``i`` of the row-major
whole array takes output ``i`` (uniform) or outputs ``2i`` and ``2i + 1`` (normal) of numpy's
Philox generator keyed by the seed. Philox is counter-based, so a rank jumps straight to the
outputs of its own piece and draws nothing else, and a sharded random array is the same global
array on any mesh and placements (what torch's offset-based RNG tracker is for).

The whole array on one process, for checking (``seed``, ``n`` elements)::

    raw = np.random.Philox(key=seed).random_raw(n)          # uniform, float64
    u = (raw >> np.uint64(11)) * 2.0**-53
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

CHUNK = 1 << 20  # outputs drawn and converted at a time: bounds the temporaries


def piece(
    seed: int,
    shape: Sequence[int],
    offsets: Sequence[int],
    sizes: Sequence[int],
    dtype: np.dtype,
    normal: bool,
) -> np.ndarray:
    """The box ``offsets``/``sizes`` of the random array of ``shape`` from ``seed``: uniform
    on [0, 1), or standard normal, in ``dtype`` (a floating type)."""
    out = np.empty(tuple(sizes), dtype)
    flat = out.reshape(-1)
    per = 2 if normal else 1
    convert = _normal if normal else _uniform
    generator = np.random.Philox(key=seed)
    state = generator.state
    done = 0
    for start, length in runs(shape, offsets, sizes):
        for first in range(0, length, CHUNK):
            n = min(CHUNK, length - first)
            raw = _outputs(generator, state, (start + first) * per, n * per)
            flat[done : done + n] = convert(raw, dtype)
            done += n
    return out


def runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]):
    """The box as runs of consecutive row-major indices of the whole array, in the box's own
    row-major order: ``(first index, length)``. The dimensions after the last partial one are
    whole, so each run spans them."""
    if 0 in sizes:
        return
    ndim = len(shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(ndim)]
    partial = [d for d in range(ndim) if offsets[d] != 0 or sizes[d] != shape[d]]
    if not partial:
        yield 0, math.prod(shape)
        return
    last = partial[-1]
    length = sizes[last] * strides[last]
    base = offsets[last] * strides[last]
    for index in np.ndindex(*sizes[:last]):
        yield (
            base + sum((offsets[d] + i) * strides[d] for d, i in enumerate(index)),
            length,
        )


def _outputs(generator: np.random.Philox, state: dict, first: int, count: int) -> np.ndarray:
    """Outputs ``first`` to ``first + count`` of the keyed stream. Each counter value gives four
    outputs; setting the state (a quarter of the cost of a new generator) moves to the block
    of ``first``, and the outputs before it in that block are skipped."""
    state["state"]["counter"] = np.array([first // 4, 0, 0, 0], np.uint64)
    state["buffer_pos"] = 4
    generator.state = state
    if first % 4:
        generator.random_raw(first % 4)
    return generator.random_raw(count)


def _uniform(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """[0, 1) with every value a multiple of 2**-bits, exact in ``dtype`` (never rounds to 1)."""
    bits = np.finfo(dtype).nmant + 1
    return ((raw >> np.uint64(64 - bits)) * 2.0**-bits).astype(dtype, copy=False)


def _normal(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Box–Muller on each pair of outputs: one standard normal per pair."""
    u1 = ((raw[0::2] >> np.uint64(11)) + np.uint64(1)) * 2.0**-53  # (0, 1]: log is finite
    u2 = (raw[1::2] >> np.uint64(11)) * 2.0**-53
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(dtype, copy=False)
