"""Random values that depend on the element, not on the layout: element ``i`` of the row-major
whole array takes output ``i`` (uniform) or outputs ``2i`` and ``2i + 1`` (normal) of numpy's
Philox generator keyed by the seed. Philox is counter-based, so a rank jumps straight to the
outputs of its own piece and draws nothing else, and a sharded random array is the same global
array on any mesh and placements (what torch's offset-based RNG tracker is for). bfloat16
takes ml_dtypes' bits, like the other floats.

The whole array on one process, for checking (``seed``, ``n`` elements)::

    raw = np.random.Philox(key=seed).random_raw(n)          # uniform, float64
    u = (raw >> np.uint64(11)) * 2.0**-53
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

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
    on [0, 1), or standard normal, in ``dtype`` (a floating type).

    The box is drawn as spans of the stream, one per index of its dimensions before ``k``
    (:func:`_span_dim`), each covering its rows along ``k`` and after: a span drawn whole
    costs the outputs between the box's pieces of a row, a jump costs a state change, and the
    cheaper mix is taken (a piece of a few columns of many rows is a few long spans, not one
    short run per row)."""
    out = np.empty(tuple(sizes), dtype)
    convert = _normal if normal else _uniform
    per = 2 if normal else 1
    generator = np.random.Philox(key=seed)
    state = generator.state
    if out.size == 0:
        return out
    if not shape:  # one element
        out[()] = convert(_outputs(generator, state, 0, per), dtype)[0]
        return out
    ndim = len(shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(ndim)]
    k = _span_dim(shape, offsets, sizes, strides)
    tail = 1 + sum((sizes[d] - 1) * strides[d] for d in range(k + 1, ndim))  # one row of k
    rows = max(1, CHUNK // strides[k])  # rows of dimension k per span: bounds a span's size
    steps = tuple(strides[d] * out.itemsize for d in range(k, ndim))
    box = out.reshape((-1, *sizes[k:]))
    for outer, index in enumerate(np.ndindex(*sizes[:k])):
        corner = [offsets[d] + i for d, i in enumerate(index)] + list(offsets[k:])
        start = sum(c * s for c, s in zip(corner, strides, strict=True))
        for r in range(0, sizes[k], rows):
            target = box[outer, r : r + rows]
            extent = (len(target) - 1) * strides[k] + tail
            dense = extent == target.size  # the span is the box's part: drawn in place
            span = target.reshape(-1) if dense else np.empty(extent, dtype)
            first = (start + r * strides[k]) * per
            for done in range(0, extent, CHUNK):
                n = min(CHUNK, extent - done)
                raw = _outputs(generator, state, first + done * per, n * per)
                span[done : done + n] = convert(raw, dtype)
            if not dense:
                target[...] = as_strided(span, target.shape, steps, writeable=False)
    return out


#: a jump (a state change and a call) costs about as much as drawing this many outputs
JUMP_COST = 256


def _span_dim(shape, offsets, sizes, strides) -> int:
    """The dimension from which each span covers the box's rows: the one of least cost,
    (spans) x (jump + outputs per span). Past the last partial dimension spans only grow."""
    ndim = len(shape)
    partial = [d for d in range(ndim) if offsets[d] != 0 or sizes[d] != shape[d]]
    if not partial:
        return 0

    def cost(k: int) -> int:
        extent = 1 + sum((sizes[d] - 1) * strides[d] for d in range(k, ndim))
        return math.prod(sizes[:k]) * (JUMP_COST + extent)

    return min(range(partial[-1] + 1), key=cost)


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
    bits = min(_finfo(dtype).nmant + 1, 53)  # the product is a float64
    return ((raw >> np.uint64(64 - bits)) * 2.0**-bits).astype(dtype, copy=False)


def _finfo(dtype: np.dtype):
    """numpy's finfo, or ml_dtypes' for bfloat16 (numpy's kind "V")."""
    try:
        return np.finfo(dtype)
    except ValueError:  # bfloat16 (ml_dtypes)
        import ml_dtypes

        return ml_dtypes.finfo(dtype)


def _normal(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Box–Muller on each pair of outputs: one standard normal per pair."""
    u1 = ((raw[0::2] >> np.uint64(11)) + np.uint64(1)) * 2.0**-53  # (0, 1]: log is finite
    u2 = (raw[1::2] >> np.uint64(11)) * 2.0**-53
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(dtype, copy=False)
