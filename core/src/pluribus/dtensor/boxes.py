"""Boxes of a global array: where a layout puts a rank's piece, where a box of a tensor lies in
the same tensor with its leading dimension split into equal blocks (a fused q, k, v projection
saved blocks first), and :class:`Pieces`, a rank's boxes of an array that no DTensor layout
describes. The checkpoint writes and reads boxes; the parallel state dicts build them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import distributed as dist
from ..arrays import device_of
from .api import DTensor
from .layout import Layout

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def layout_box(layout: Layout, coordinate: Sequence[int]) -> Box:
    """The box of the global tensor that ``layout`` gives the mesh ``coordinate``."""
    slices, shape = layout.local_slices(coordinate), layout.shape
    offsets = tuple(s.indices(n)[0] for s, n in zip(slices, shape, strict=True))
    sizes = tuple(len(range(*s.indices(n))) for s, n in zip(slices, shape, strict=True))
    return offsets, sizes


def dtensor_box(tensor: DTensor) -> Box:
    """The box of the global tensor this rank's piece covers."""
    return layout_box(tensor.layout, tensor.device_mesh.coordinate)


def regrouped(box: Box, shape: tuple[int, ...], saved: tuple[int, ...]) -> list | None:
    """Where ``box`` of a tensor of ``shape`` lies in the same tensor saved as ``saved``, when
    the two differ only in the leading dimension split into equal blocks: ``(n, ...)`` and
    ``(k, n / k, ...)`` (a fused q, k, v projection whole, or with its blocks first as a
    tensor-parallel checkpoint holds it). A list of ``(index, box in saved)``: ``index`` picks
    from the destination piece the part that fills the saved box (reshaped to its sizes); None
    when the shapes are not such a pair."""
    (offsets, sizes), parts = box, []
    if not shape or not saved:  # a 0-d tensor has no leading dimension to split
        return None
    if len(saved) == len(shape) + 1 and saved[2:] == shape[1:] and saved[0] * saved[1] == shape[0]:
        m = saved[1]  # rows per block
        first, end = offsets[0], offsets[0] + sizes[0]
        blocks = range(first // m, -(-end // m)) if m and sizes[0] else range(0)  # overlapped
        for b in blocks:
            lo, hi = max(first, b * m), min(end, (b + 1) * m)
            index = (slice(lo - first, hi - first),)
            parts.append((index, ((b, lo - b * m, *offsets[1:]), (1, hi - lo, *sizes[1:]))))
        return parts
    if len(shape) == len(saved) + 1 and shape[2:] == saved[1:] and shape[0] * shape[1] == saved[0]:
        m = shape[1]
        for b in range(offsets[0], offsets[0] + sizes[0]):
            start = b * m + offsets[1]
            parts.append(((b - offsets[0],), ((start, *offsets[2:]), sizes[1:])))
        return parts
    return None


def _box_text(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    return f"offsets {list(offsets)} sizes {list(sizes)}"


@dataclass(frozen=True)
class Pieces:
    """This rank's boxes of one global array of ``shape``: ``pieces`` is a list of
    ``(offsets, array)``, each array (numpy or cupy, one dtype) the box at ``offsets``.

    For a layout no DTensor describes: FSDP's rows of a tensor-parallel piece (two mesh
    dimensions cutting one tensor dimension, or rows that cross a fused projection's blocks).
    ``checkpoint.save`` writes each box as it writes a DTensor piece (a box several ranks hold,
    once); ``checkpoint.load`` fills each array in place. The boxes must lie inside ``shape``
    and not overlap; empty boxes are allowed and skipped. ``dtype`` is the arrays' (needed only
    when there are none); ``layout`` says how the boxes were cut, for ``inspect``."""

    shape: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, ...], Any], ...]
    dtype: Any = None
    layout: str = ""

    def __post_init__(self) -> None:
        who = f"rank {dist.get_rank()}" if dist.is_initialized() else "rank 0"
        shape, pieces = self.shape, self.pieces
        if not isinstance(shape, (tuple, list)) or not all(
            isinstance(n, (int, np.integer)) and n >= 0 for n in shape
        ):
            raise ValueError(
                f"{who}: Pieces(shape={shape!r}): the global shape must be a tuple of "
                "non-negative ints"
            )
        shape = tuple(int(n) for n in shape)
        if not isinstance(pieces, (tuple, list)):
            raise ValueError(
                f"{who}: Pieces of {list(shape)}: pieces must be a list of (offsets, array), "
                f"not {type(pieces).__name__}"
            )
        boxes, dtypes = [], set()
        for i, piece in enumerate(pieces):
            if not isinstance(piece, (tuple, list)) or len(piece) != 2:
                raise ValueError(
                    f"{who}: Pieces of {list(shape)}: piece {i} is not an (offsets, array) pair"
                )
            offsets, array = piece
            if not (isinstance(array, np.ndarray) or device_of(array) == "cuda"):
                raise ValueError(
                    f"{who}: Pieces of {list(shape)}: piece {i} holds a "
                    f"{type(array).__name__}; each box is a numpy or cupy array"
                )
            ok = isinstance(offsets, (tuple, list)) and all(
                isinstance(o, (int, np.integer)) for o in offsets
            )
            offsets = tuple(int(o) for o in offsets) if ok else offsets
            sizes = tuple(int(n) for n in array.shape)
            if not ok or len(offsets) != len(shape) or len(sizes) != len(shape):
                raise ValueError(
                    f"{who}: Pieces of {list(shape)}: piece {i} has offsets {offsets!r} and an "
                    f"array of shape {list(sizes)}; both need {len(shape)} dimensions, as the "
                    "global shape has"
                )
            if any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
                raise ValueError(
                    f"{who}: Pieces of {list(shape)}: piece {i} ({_box_text(offsets, sizes)}) "
                    "reaches outside the global shape"
                )
            dtypes.add(np.dtype(array.dtype))
            boxes.append((offsets, sizes, array))
        if self.dtype is not None:
            dtypes.add(np.dtype(self.dtype))
        if len(dtypes) > 1:
            raise ValueError(
                f"{who}: Pieces of {list(shape)}: the boxes have dtypes "
                f"{sorted(d.name for d in dtypes)}; one array's boxes share one dtype"
            )
        if not dtypes:
            raise ValueError(
                f"{who}: Pieces of {list(shape)} with no boxes: pass dtype= (every rank saves "
                "the dtype, holding boxes or not)"
            )
        full = [(o, s) for o, s, _ in boxes if math.prod(s) > 0]
        for a, (oa, sa) in enumerate(full):
            for ob, sb in full[a + 1 :]:
                if all(
                    max(x, y) < min(x + m, y + n) for x, m, y, n in zip(oa, sa, ob, sb, strict=True)
                ):
                    raise ValueError(
                        f"{who}: Pieces of {list(shape)}: the boxes at {_box_text(oa, sa)} and "
                        f"{_box_text(ob, sb)} overlap; each element belongs to one box"
                    )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "pieces", tuple((o, a) for o, _, a in boxes))
        object.__setattr__(self, "dtype", dtypes.pop())

    @property
    def ndim(self) -> int:
        return len(self.shape)
