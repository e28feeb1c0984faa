"""How a tensor lies along one mesh dimension: split (``Shard``), copied (``Replicate``) or
summed later (``Partial``). Placements are small immutable values, hashable, so that a pair of
layouts can key the plan cache."""

from __future__ import annotations

from dataclasses import dataclass

from ..types import ReduceOp

#: Partial's reduction names and the collective op that finishes each.
PARTIAL_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN}


class Placement:
    """Base class of :class:`Shard`, :class:`Replicate` and :class:`Partial`."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Tensor dimension ``dim`` is split over the mesh dimension (numpy's ``array_split`` sizes
    unless the layout records others)."""

    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank along the mesh dimension holds the whole (sub)tensor."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Every rank holds a term; the tensor is their ``op`` (sum, avg, max or min)."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise ValueError(f"Partial op must be one of {sorted(PARTIAL_OPS)}, got {self.op!r}")

    @property
    def reduce_op(self) -> ReduceOp:
        return PARTIAL_OPS[self.op]

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.op!r})" if self.op != "sum" else "Partial()"
