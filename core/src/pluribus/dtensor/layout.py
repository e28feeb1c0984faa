"""Where every element of a DTensor lives: global shape, one placement per mesh dimension and,
for each ``Shard``, the size of every rank's piece.

The sizes are data, never guessed from the local shapes of other ranks: by default numpy's
``array_split`` rule (5 rows over 4 ranks: 2, 1, 1, 1; zero-size pieces allowed), or the sizes
``from_local`` found. Each tensor dimension is sharded by at most one mesh dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..arrays import check_op, supported_dtypes
from .placements import Partial, Placement, Replicate, Shard


def split_sizes(length: int, parts: int) -> tuple[int, ...]:
    """numpy's ``array_split`` sizes: the first ``length % parts`` pieces get one more."""
    base, extra = divmod(length, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


class Layout:
    """A DTensor's distribution: global ``shape``, one placement per mesh dimension, and per mesh
    dimension the sizes of the pieces along the sharded tensor dimension (None where not
    sharded).

    Layouts are immutable and interned like placements: equal layouts are the same object, so
    the plan cache, keyed by them, compares and hashes by identity. The table keeps every
    distinct layout made (a few hundred bytes each), as the plan cache keeps a plan per layout
    pair. One slot is a memo, not part of the value: ``last_redistribute``, the last
    redistribute from this layout (``(mesh, placements as given, array type, dtype, donate,
    target layout, compiled plan)``, set by :mod:`pluribus.dtensor.api`), which a repeated
    ``redistribute`` reads instead of looking its plan up; it keeps that one mesh alive until
    a redistribute from this layout on another mesh replaces it."""

    __slots__ = ("shape", "placements", "sizes", "last_redistribute")
    _made: dict[tuple, Layout] = {}

    def __new__(
        cls,
        shape: Sequence[int],
        placements: Sequence[Placement],
        sizes: Sequence[Sequence[int] | None],
    ) -> Layout:
        key = (shape, placements, sizes)
        try:
            return cls._made[key]
        except (KeyError, TypeError):  # new, or given as lists
            pass
        shape = tuple(int(n) for n in shape)
        placements = tuple(placements)
        sizes = tuple(None if s is None else tuple(int(n) for n in s) for s in sizes)
        made = object.__new__(cls)
        for name, value in zip(cls.__slots__, (shape, placements, sizes, None), strict=True):
            object.__setattr__(made, name, value)
        return cls._made.setdefault((shape, placements, sizes), made)

    def __setattr__(self, name: str, value) -> None:
        if name != "last_redistribute":
            raise AttributeError("a Layout is immutable; use with_placement for another one")
        object.__setattr__(self, name, value)

    def __reduce__(self):
        return Layout, (self.shape, self.placements, self.sizes)

    def local_shape(self, coordinate: Sequence[int]) -> tuple[int, ...]:
        shape = list(self.shape)
        for m, p in enumerate(self.placements):
            if isinstance(p, Shard):
                shape[p.dim] = self.sizes[m][coordinate[m]]
        return tuple(shape)

    def local_slices(self, coordinate: Sequence[int]) -> tuple[slice, ...]:
        """This coordinate's piece of the global tensor, as slices."""
        index = [slice(None)] * len(self.shape)
        for m, p in enumerate(self.placements):
            if isinstance(p, Shard):
                sizes = self.sizes[m]
                start = sum(sizes[: coordinate[m]])
                index[p.dim] = slice(start, start + sizes[coordinate[m]])
        return tuple(index)

    def zero_term(self, coordinate: Sequence[int]) -> bool:
        """Whether this coordinate's piece is a zero term of a ``Partial("sum")``: a value
        made here (distributed, filled, drawn or assigned) is held once, by the first rank of
        each such mesh dimension, so that the sum is the value."""
        return any(
            isinstance(p, Partial) and p.op == "sum" and coordinate[m] != 0
            for m, p in enumerate(self.placements)
        )

    def with_placement(self, mesh_dim: int, placement: Placement, sizes=None) -> Layout:
        placements = list(self.placements)
        all_sizes = list(self.sizes)
        placements[mesh_dim] = placement
        all_sizes[mesh_dim] = sizes
        return Layout(self.shape, tuple(placements), tuple(all_sizes))

    def __repr__(self) -> str:
        uneven = [f"{m}:{s}" for m, s in enumerate(self.sizes) if s is not None and len(set(s)) > 1]
        extra = f", sizes {{{', '.join(uneven)}}}" if uneven else ""
        return f"Layout({self.shape}, {list(self.placements)}{extra})"


def normalize_placements(
    placements: Sequence[Placement],
    ndim: int,
    mesh_shape: tuple[int, ...],
    rank: int,
    dtype: Any = None,
) -> tuple[Placement, ...]:
    """Check ``placements`` against the mesh and the tensor (and each ``Partial`` against the
    ``dtype`` of its terms: the collective that finishes it must accept them); turn
    ``Shard(-1)`` into ``Shard(ndim - 1)``."""
    placements = tuple(placements)
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"rank {rank}: {len(placements)} placements {list(placements)} for a mesh of "
            f"{len(mesh_shape)} dimensions {mesh_shape}; give one per mesh dimension"
        )
    out: list[Placement] = []
    sharded: dict[int, int] = {}
    for m, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise TypeError(f"rank {rank}: placement {p!r} is not a Shard, Replicate or Partial")
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(
                    f"rank {rank}: Shard({p.dim}) on mesh dimension {m}: the tensor has "
                    f"{ndim} dimension(s)"
                )
            p = Shard(p.dim % ndim)
            if p.dim in sharded:
                raise ValueError(
                    f"rank {rank}: tensor dimension {p.dim} is sharded on mesh dimensions "
                    f"{sharded[p.dim]} and {m}; shard each tensor dimension on one mesh "
                    "dimension (or flatten those mesh dimensions into one)"
                )
            sharded[p.dim] = m
        out.append(p)
    ops = {p.op for p in out if isinstance(p, Partial)}
    if len(ops) > 1 and not ops <= {"sum", "avg"}:
        raise ValueError(
            f"rank {rank}: placements {list(out)} mix Partial ops {sorted(ops)} whose order of "
            "reduction matters; reduce one (redistribute it to Replicate) first"
        )
    for m, p in enumerate(out):
        if dtype is not None and isinstance(p, Partial):
            try:
                check_op(p.reduce_op, dtype, rank)
                if np.dtype(dtype) not in supported_dtypes():
                    raise TypeError(f"rank {rank}: the collectives do not reduce {dtype}")
            except TypeError as exc:
                raise TypeError(f"{exc} ({p!r} on mesh dimension {m})") from None
    return tuple(out)


def default_layout(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> Layout:
    sizes = tuple(
        split_sizes(shape[p.dim], mesh_shape[m]) if isinstance(p, Shard) else None
        for m, p in enumerate(placements)
    )
    return Layout(tuple(shape), placements, sizes)


def replicated(shape: tuple[int, ...], mesh_ndim: int) -> Layout:
    return Layout(tuple(shape), (Replicate(),) * mesh_ndim, (None,) * mesh_ndim)
