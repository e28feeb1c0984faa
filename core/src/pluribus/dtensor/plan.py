"""Redistribute plans: the collectives that turn one layout into another, one mesh dimension at a
time, with their byte counts and an alpha-beta estimate of their time.

Each mesh dimension changes with its cheapest step: Shard->Replicate all-gather,
Partial->Replicate all-reduce (out of place unless the source may be written), Partial->Shard
reduce-scatter, Shard(i)->Shard(j) (or the same dimension with other sizes) all-to-all,
Replicate->Shard and Replicate->Partial local. Steps that shrink the data go first and
all-gathers last, so later steps move less; where two mesh dimensions trade tensor dimensions
(Shard(0), Shard(1) -> Shard(1), Shard(0)) one of them is gathered first, because a tensor
dimension is sharded by one mesh dimension at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .layout import Layout
from .placements import Partial, Placement, Replicate, Shard

#: step kinds in the order the planner prefers them (cheapest and most shrinking first)
_ORDER = {
    "shard_local": 0,
    "partial_local": 1,
    "reduce_scatter": 2,
    "all_reduce": 3,
    "all_to_all": 4,
    "all_gather": 5,
}


@dataclass(frozen=True)
class CostModel:
    """``alpha`` seconds per message, ``beta`` seconds per byte (ring algorithms). The defaults
    are gloo's over loopback TCP on the machines of BENCHMARKS.md, to within a factor of two."""

    alpha: float = 30e-6
    beta: float = 1 / 1.5e9


DEFAULT_COST = CostModel()


@dataclass(frozen=True)
class Step:
    """One collective (or local operation) on one mesh dimension."""

    kind: str  # a key of _ORDER
    mesh_dim: int
    src: Placement
    dst: Placement
    group_size: int
    #: bytes this rank puts into the collective (its input), and takes out of it
    bytes_in: int
    bytes_out: int
    seconds: float
    src_sizes: tuple[int, ...] | None = None
    dst_sizes: tuple[int, ...] | None = None
    #: every piece of the sharded side the same size (the collectives' single-array form)
    even: bool = False
    #: the public collectives this step calls, in order, each ``(name, bytes in, bytes out)``
    calls: tuple[tuple[str, int, int], ...] = ()
    #: an all-reduce's way: ``"in place"`` where the piece may be written (``donate``, or an
    #: array an earlier step made), else ``"out of place"`` (``all_reduce(piece, out=new)``,
    #: the piece left as it was); None for the other kinds
    how: str | None = None

    @property
    def collective(self) -> str | None:
        """The operation this step performs (a collective's name), or None for a local step."""
        return None if self.kind.endswith("_local") else self.kind

    def __str__(self) -> str:
        what = self.collective or "local"
        if self.how == "out of place":
            what = "all_reduce out of place"
        return (
            f"mesh dim {self.mesh_dim}: {self.src!r} -> {self.dst!r}: {what} over "
            f"{self.group_size} ranks, {self.bytes_in:,} B in, {self.bytes_out:,} B out, "
            f"~{self.seconds * 1e6:.1f} us"
        )


@dataclass(frozen=True)
class Plan:
    """What ``redistribute`` from ``src`` to ``dst`` will do on this rank, step by step."""

    src: Layout
    dst: Layout
    steps: tuple[Step, ...]
    #: the layout before each step, and the final one
    layouts: tuple[Layout, ...] = field(repr=False)

    @property
    def cost(self) -> float:
        """Predicted seconds (alpha-beta)."""
        return sum(s.seconds for s in self.steps)

    @property
    def collectives(self) -> list[str]:
        """The operations it calls (:data:`~pluribus.operations.OPERATIONS` names), in order."""
        return [name for s in self.steps for name, _, _ in s.calls]

    def __str__(self) -> str:
        lines = [f"redistribute {self.src} -> {self.dst}: ~{self.cost * 1e6:.1f} us"]
        lines += [f"  {i}. {s}" for i, s in enumerate(self.steps, 1)]
        if not self.steps:
            lines.append("  (nothing to do)")
        return "\n".join(lines)


def _volume(layout: Layout, coordinate, itemsize: int) -> int:
    return math.prod(layout.local_shape(coordinate)) * itemsize


def _largest(layout: Layout) -> int:
    """Elements of the largest piece any rank holds: the same on every rank, so that every
    rank orders the steps alike."""
    shape = list(layout.shape)
    for m, p in enumerate(layout.placements):
        if isinstance(p, Shard):
            shape[p.dim] = max(layout.sizes[m], default=0)
    return math.prod(shape)


def _kind(src: Placement, dst: Placement) -> str:
    if isinstance(src, Shard):
        return "all_to_all" if isinstance(dst, Shard) else "all_gather"
    if isinstance(src, Partial):
        if isinstance(dst, Shard):
            return "reduce_scatter"
        return "all_reduce"  # to Replicate, or to Partial with another op (via Replicate)
    return "shard_local" if isinstance(dst, Shard) else "partial_local"


def _ring_seconds(kind: str, p: int, nbytes: int, cost: CostModel) -> float:
    """alpha-beta time of a ring collective over ``p`` ranks: an all-reduce of ``nbytes``, or
    an all-gather, reduce-scatter or all-to-all whose largest piece (what every one of its
    ``p - 1`` steps waits for) is ``nbytes``."""
    if kind.endswith("_local") or p == 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (p - 1) * cost.alpha + 2 * (p - 1) / p * nbytes * cost.beta
    return (p - 1) * (cost.alpha + nbytes * cost.beta)


def _part_bytes(layout: Layout, coordinate, itemsize: int, cut: dict[int, int]) -> int:
    """Bytes of a piece of ``layout`` as this rank holds it (the ranks of one mesh dimension's
    group hold the same elsewhere) with the tensor dimensions in ``cut`` given those sizes."""
    shape = list(layout.local_shape(coordinate))
    for dim, size in cut.items():
        shape[dim] = size
    return math.prod(shape) * itemsize


def _all_reduce_way(
    p: int, nbytes: int, writable: bool, cost: CostModel
) -> tuple[str, tuple[tuple[str, int, int], ...], float]:
    """How a Partial->Replicate step reduces ``nbytes``: (way, calls, predicted seconds). Out
    of place costs what in place does where the backend reduces into the output (gloo copies
    the input into its shared segment either way; MPI and NCCL take a send buffer)."""
    ring = _ring_seconds("all_reduce", p, nbytes, cost)
    if writable:
        return "in place", (("all_reduce", nbytes, nbytes),), ring
    return "out of place", (("all_reduce_into", nbytes, nbytes),), ring


def make_plan(
    src: Layout,
    dst: Layout,
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    itemsize: int,
    cost: CostModel = DEFAULT_COST,
    donate: bool = False,
) -> Plan:
    """The cheapest sequence of steps from ``src`` to ``dst`` (both checked already).
    ``donate``: the source's piece may be written over."""
    state = src
    writable = donate  # after a collective the piece is a new array, ours to write
    pending = [
        m
        for m in range(len(mesh_shape))
        if src.placements[m] != dst.placements[m] or src.sizes[m] != dst.sizes[m]
    ]
    steps: list[Step] = []
    layouts: list[Layout] = []

    def sharded_elsewhere(dim: int, m: int) -> bool:
        return any(
            isinstance(p, Shard) and p.dim == dim and k != m for k, p in enumerate(state.placements)
        )

    def add(m: int, target: Placement, target_sizes) -> None:
        nonlocal state, writable
        p_from = state.placements[m]
        kind = _kind(p_from, target)
        after = state.with_placement(m, target, target_sizes)
        before_bytes = _volume(state, coordinate, itemsize)
        after_bytes = _volume(after, coordinate, itemsize)
        p = mesh_shape[m]
        how = None
        if kind == "all_reduce":
            how, calls, seconds = _all_reduce_way(p, before_bytes, writable, cost)
        else:
            if kind == "all_gather":  # each ring step waits for the largest piece
                cut = {p_from.dim: max(state.sizes[m])}
            elif kind == "reduce_scatter":
                cut = {target.dim: max(target_sizes)}
            elif kind == "all_to_all":  # a part: one sender's rows of one receiver's columns
                sent, got = max(state.sizes[m]), max(target_sizes)
                if p_from.dim == target.dim:  # the dimension cut anew: overlaps of two pieces
                    cut = {p_from.dim: min(sent, got)}
                else:
                    cut = {p_from.dim: sent, target.dim: got}
            else:
                cut = None
            layout = after if kind == "reduce_scatter" else state
            piece = 0 if cut is None else _part_bytes(layout, coordinate, itemsize, cut)
            seconds = _ring_seconds(kind, p, piece, cost)
            calls = () if kind.endswith("_local") else ((kind, before_bytes, after_bytes),)
        steps.append(
            Step(
                kind,
                m,
                p_from,
                target,
                p,
                before_bytes,
                after_bytes,
                seconds,
                state.sizes[m],
                target_sizes,
                len(set(state.sizes[m] or target_sizes or (0,))) == 1,
                calls,
                how,
            )
        )
        layouts.append(state)
        state = after
        writable = writable or bool(calls)

    while pending:
        ready = []
        for m in pending:
            target = dst.placements[m]
            if isinstance(target, Shard) and sharded_elsewhere(target.dim, m):
                continue
            kind = _kind(state.placements[m], target)
            order = _ORDER[kind]
            if kind == "all_to_all":  # one that shrinks the pieces runs with the shrinking steps
                after = state.with_placement(m, target, dst.sizes[m])
                if _largest(after) < _largest(state):
                    order = _ORDER["reduce_scatter"]
            ready.append((order, m))
        if not ready:  # mesh dimensions trading tensor dimensions: gather one first, the one
            # with the smallest group (the piece grows by its size)
            m = min(pending, key=lambda k: (mesh_shape[k], k))
            add(m, Replicate(), None)
            continue
        _, m = min(ready)
        pending.remove(m)
        target, src_p = dst.placements[m], state.placements[m]
        if isinstance(src_p, Partial) and isinstance(target, Partial):
            add(m, Replicate(), None)  # Partial(op1) -> Partial(op2): reduce, then split again
        if isinstance(src_p, Shard) and isinstance(target, Partial):
            add(m, Replicate(), None)
        add(m, target, dst.sizes[m])
    layouts.append(state)
    return Plan(src, dst, tuple(steps), tuple(layouts))
