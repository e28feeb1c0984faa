"""How a tensor lies along one mesh dimension: split (``Shard``), copied (``Replicate``) or
summed later (``Partial``).

Placements are immutable values, and *interned*: ``Shard(0)`` returns the same object every
time, so equal placements are identical. Equality and hashing are then the interpreter's own
identity checks, which keeps the plan-cache lookup of every ``redistribute`` cheap (a
dataclass's ``__eq__`` and ``__hash__`` are Python calls, about 0.1 µs each per lookup)."""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any

from ..types import ReduceOp

#: Partial's reduction names and the collective op that finishes each.
PARTIAL_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN}


class Placement:
    """Base class of :class:`Shard`, :class:`Replicate` and :class:`Partial`."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self!r} is immutable; make a new placement instead")

    def __copy__(self) -> Placement:
        return self

    def __deepcopy__(self, memo: dict) -> Placement:
        return self


def _interned(cls: type, table: dict, key: Any, **fields: Any) -> Any:
    """The one instance of ``cls`` for ``key``, made with ``fields`` the first time."""
    made = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(made, name, value)
    return table.setdefault(key, made)


class _ShardType(type):
    """The metaclass of :class:`Shard`: ``Shard(dim)`` for a dim seen before is one C call (a
    cache hit, set below), not a Python ``__new__``; a new dim, a keyword or a bad value goes on
    to :meth:`Shard._make`, which checks it. ``redistribute(placements=[Shard(0)])`` builds one
    per call."""


class Shard(Placement, metaclass=_ShardType):
    """Tensor dimension ``dim`` is split over the mesh dimension (numpy's ``array_split`` sizes
    unless the layout records others)."""

    __slots__ = ("dim",)
    __match_args__ = ("dim",)
    _made: dict[int, Shard] = {}

    @staticmethod
    def _make(dim: int) -> Shard:
        try:
            dim = int(operator.index(dim))
        except TypeError:
            raise TypeError(f"Shard(dim): dim must be an integer, got {dim!r}") from None
        return _interned(Shard, Shard._made, dim, dim=dim)

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __reduce__(self):
        return Shard, (self.dim,)

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


# lru_cache's wrapper is C; staticmethod keeps it from binding the class as a first argument
Shard._make.__qualname__ = "Shard"  # what a call's TypeError names
_ShardType.__call__ = staticmethod(functools.lru_cache(maxsize=None)(Shard._make))


class _OneInstance(type):
    """The metaclass of :class:`Replicate`: calling the class returns its one instance through a
    C callable (set below, once that instance exists) instead of a Python ``__new__``. A loop of
    ``redistribute(placements=[Replicate()])`` builds one per call, and the Python call cost
    2-3 % of a 64 KiB all-gather on 2 ranks."""


class Replicate(Placement, metaclass=_OneInstance):
    """Every rank along the mesh dimension holds the whole (sub)tensor."""

    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def __reduce__(self):
        return Replicate, ()

    def __repr__(self) -> str:
        return "Replicate()"


_REPLICATE = object.__new__(Replicate)
_OneInstance.__call__ = itertools.repeat(_REPLICATE).__next__  # Replicate() is _REPLICATE


class Partial(Placement):
    """Every rank holds a term; the tensor is their ``op`` (sum, avg, max or min)."""

    __slots__ = ("op", "reduce_op")
    __match_args__ = ("op",)
    _made: dict[str, Partial] = {}

    def __new__(cls, reduce_op: Any = "sum") -> Partial:
        try:
            return cls._made[reduce_op]
        except (KeyError, TypeError):
            pass
        op = reduce_op
        for name, member in PARTIAL_OPS.items():  # torch's spelling takes the enum as well
            if reduce_op is member:
                op = name
        if not isinstance(op, str) or op not in PARTIAL_OPS:
            raise ValueError(
                f"Partial's reduce_op must be one of {sorted(PARTIAL_OPS)} (or the ReduceOp of "
                f"one), got {reduce_op!r}"
            )
        return _interned(cls, cls._made, op, op=op, reduce_op=PARTIAL_OPS[op])

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or Partial(reduce_op) is self

    def __reduce__(self):
        return Partial, (self.op,)

    def __repr__(self) -> str:
        return f"Partial({self.op!r})" if self.op != "sum" else "Partial()"
