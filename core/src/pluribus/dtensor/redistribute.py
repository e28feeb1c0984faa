"""Run a redistribute plan: each step's collective on its mesh dimension's group, through the
public collectives only. Uneven pieces travel as lists of arrays (the uneven all-gather,
reduce-scatter and all-to-all); equal ones as single arrays, the collectives' fast path.

A plan is compiled once per (layout pair, array type, dtype) into one function per step, with
the group, the reduction and the single-array-or-list choice already made, so that a repeated
redistribute costs a cache lookup and the collective. A step function takes ``(local,
async_op)``. Synchronous, it returns the new local array. With ``async_op`` it returns ``(work,
out, post)``: once ``work`` (None for a local step) is done, the new local array is ``out``, or
``post(out)`` where a layout change is left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import distributed as dist
from .plan import Plan, Step

Run = Callable[[Any, bool], Any]


def _front(xp: Any, array: Any, dim: int) -> Any:
    """``array`` with ``dim`` moved first, contiguous (a view when it already is)."""
    return xp.ascontiguousarray(xp.moveaxis(array, dim, 0) if dim else array)


def _offsets(sizes) -> list[int]:
    out, start = [], 0
    for n in sizes:
        out.append(start)
        start += n
    return out


def _ordered(perm: list[int], items: list) -> list:
    """``items`` (one per index along the mesh dimension) in the order of the group's ranks."""
    out = [None] * len(items)
    for k, item in enumerate(items):
        out[perm[k]] = item
    return out


def compile_plan(mesh: Any, plan: Plan, xp: Any, dtype: Any) -> Run:
    """One function that runs every step of ``plan`` on arrays of namespace ``xp`` and
    ``dtype`` (only the last collective runs in the background: each step needs the one
    before). Each step's new array has its shape worked out here, from the layout before the
    step: building it from the piece's shape on every call costs more than the allocation."""
    runs = [
        _compile_step(mesh, step, xp, dtype, plan.layouts[k].local_shape(mesh.coordinate))
        for k, step in enumerate(plan.steps)
    ]
    if not runs:
        return _local_step(None)
    if len(runs) == 1:
        return runs[0]
    *first, last = runs

    def run_all(local, async_op):
        for run in first:
            local = run(local, False)
        return last(local, async_op)

    return run_all


def _compile_step(mesh: Any, step: Step, xp: Any, dtype: Any, shape: tuple[int, ...]) -> Run:
    """The function of one step whose input piece has ``shape``."""
    m, kind = step.mesh_dim, step.kind
    me = mesh.coordinate[m]
    if kind == "shard_local":
        d = step.dst.dim
        start = sum(step.dst_sizes[:me])
        index = (slice(None),) * d + (slice(start, start + step.dst_sizes[me]),)
        # a copy, not a view of the source's piece (which a donation of the result would
        # write over, and which would stay alive for the view)
        return _local_step(lambda local: local[index].copy())
    if kind == "partial_local":
        if step.dst.op == "sum" and me != 0:
            return _local_step(xp.zeros_like)
        # a term of its own: an all-reduce in place on it, once donated, writes nothing else
        return _local_step(xp.copy)
    # perm: index along mesh dimension m -> rank in the group
    group, perm, identity = mesh.group_info(m)
    if kind == "all_reduce":
        return _compile_all_reduce(step, xp, dtype, shape, group)
    if kind == "all_gather":
        front = _first(shape, step.src.dim)
        return _compile_all_gather(step, xp, dtype, front, group, perm, identity)
    if kind == "reduce_scatter":
        front = _first(shape, step.dst.dim)
        return _compile_reduce_scatter(step, xp, dtype, front, group, perm, identity, me)
    if kind == "all_to_all":
        return _compile_all_to_all(step, xp, dtype, shape, group, perm, me)
    raise AssertionError(f"unknown step {kind}")


def _local_step(new: Callable[[Any], Any] | None) -> Run:
    """The step that makes the new piece with ``new`` (None: the piece stays as it is)."""
    if new is None:
        return lambda local, async_op: (None, local, None) if async_op else local
    return lambda local, async_op: (None, new(local), None) if async_op else new(local)


def _first(shape: tuple[int, ...], d: int) -> tuple[int, ...]:
    """``shape`` with dimension ``d`` moved first (what :func:`_front` makes of it)."""
    return (shape[d], *shape[:d], *shape[d + 1 :])


def _back(d: int, xp: Any):
    """The ``post`` that moves dimension 0 back to ``d`` (None when nothing moves)."""
    if not d:
        return None
    return lambda out: xp.ascontiguousarray(xp.moveaxis(out, 0, d))


def _compile_all_reduce(step: Step, xp, dtype, shape, group) -> Run:
    op, all_reduce, empty = step.src.reduce_op, dist.all_reduce, xp.empty
    if step.how == "in place":

        def in_place(local, async_op):
            try:
                work = all_reduce(local, op, group, async_op)
            except ValueError:  # refused before anything was sent; a read-only piece: a copy
                if getattr(local.flags, "writeable", True):
                    raise
                local = local.copy()
                work = all_reduce(local, op, group, async_op)
            return (work, local, None) if async_op else local

        return in_place

    def out_of_place(local, async_op):
        out = empty(shape, dtype)  # empty_like's dispatch costs 0.2 us more
        work = all_reduce(local, op, group, async_op, out=out)
        return (work, out, None) if async_op else out

    return out_of_place


def _compile_all_gather(step: Step, xp, dtype, front, group, perm, identity) -> Run:
    """``front``: the piece's shape with the gathered dimension first."""
    d, sizes, all_gather, empty = step.src.dim, step.src_sizes, dist.all_gather, xp.empty
    shape, post = (sum(sizes), *front[1:]), _back(d, xp)
    spans = [slice(o, o + n) for o, n in zip(_offsets(sizes), sizes, strict=True)]
    single = identity and step.even

    def gather(local, async_op):
        piece = _front(xp, local, d) if d else local  # a DTensor's piece is contiguous
        out = empty(shape, dtype)
        outputs = out if single else _ordered(perm, [out[s] for s in spans])
        work = all_gather(outputs, piece, group, async_op)
        if async_op:
            return work, out, post
        return out if post is None else post(out)

    return gather


def _compile_reduce_scatter(step: Step, xp, dtype, front, group, perm, identity, me) -> Run:
    """``front``: the term's shape with the scattered dimension first."""
    d, sizes, op = step.dst.dim, step.dst_sizes, step.src.reduce_op
    reduce_scatter, post, empty = dist.reduce_scatter, _back(d, xp), xp.empty
    shape = (sizes[me], *front[1:])
    spans = [slice(o, o + n) for o, n in zip(_offsets(sizes), sizes, strict=True)]
    single = identity and step.even

    def scatter(local, async_op):
        whole = _front(xp, local, d) if d else local  # a DTensor's piece is contiguous
        out = empty(shape, dtype)
        inputs = whole if single else _ordered(perm, [whole[s] for s in spans])
        work = reduce_scatter(out, inputs, op, group, async_op)
        if async_op:
            return work, out, post
        return out if post is None else post(out)

    return scatter


def _compile_all_to_all(step: Step, xp, dtype, shape, group, perm, me) -> Run:
    """Every rank's part of the new sharding arrives straight in its place: the new piece is
    built with the gathered dimension ``i`` first, where each sender's part is one contiguous
    block (so for ``i == 0`` the piece needs no copy after the collective), and this rank's own
    part is copied there instead of being sent to itself."""
    i, j = step.src.dim, step.dst.dim
    src_sizes, dst_sizes = step.src_sizes, step.dst_sizes
    src_off, dst_off = _offsets(src_sizes), _offsets(dst_sizes)
    p = len(src_sizes)
    if i == j:  # the same dimension, other sizes: send the overlaps of the ranges
        lo = [max(src_off[me], dst_off[k]) for k in range(p)]
        hi = [min(src_off[me] + src_sizes[me], dst_off[k] + dst_sizes[k]) for k in range(p)]
        sends = [slice(lo[k] - src_off[me], max(lo[k], hi[k]) - src_off[me]) for k in range(p)]
        got = [
            max(0, min(src_off[k] + src_sizes[k], dst_off[me] + dst_sizes[me])
                - max(src_off[k], dst_off[me]))
            for k in range(p)
        ]  # fmt: skip
        along = i
    else:
        sends = [slice(dst_off[k], dst_off[k] + dst_sizes[k]) for k in range(p)]
        got, along = list(src_sizes), j
    sends = [(slice(None),) * along + (s,) for s in sends]
    blocks = [slice(o, o + n) for o, n in zip(_offsets(got), got, strict=True)]
    all_to_all, post, empty = dist.all_to_all, _back(i, xp), xp.empty
    new = list(shape)
    if i != j:
        new[j] = dst_sizes[me]
    del new[i]
    new = (sum(got), *new)  # the new piece's shape with dimension i first

    def exchange(local, async_op):
        front = empty(new, dtype)
        inputs, outputs = [None] * p, [None] * p
        for k in range(p):
            block, part = front[blocks[k]], local[sends[k]]
            if i:
                part = xp.moveaxis(part, i, 0)
            if k == me:
                block[...] = part
                part = block
            else:
                part = xp.ascontiguousarray(part)
            inputs[perm[k]], outputs[perm[k]] = part, block
        work = all_to_all(outputs, inputs, group, async_op)
        if async_op:
            return work, front, post
        return front if post is None else post(front)

    return exchange
