"""Run a redistribute plan: each step's collective on its mesh dimension's group, through the
public collectives only. Uneven pieces travel as lists of arrays (the uneven all-gather,
reduce-scatter and all-to-all); equal ones as single arrays, the collectives' fast path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import distributed as dist
from ..nn.module import array_namespace
from .layout import split_sizes
from .plan import Plan, Step

Finish = Callable[[], Any]


def _front(xp: Any, array: Any, dim: int) -> Any:
    """``array`` with ``dim`` moved first, contiguous (a view when it already is)."""
    return xp.ascontiguousarray(xp.moveaxis(array, dim, 0) if dim else array)


def _back(xp: Any, array: Any, dim: int) -> Any:
    return xp.ascontiguousarray(xp.moveaxis(array, 0, dim)) if dim else array


def _offsets(sizes) -> list[int]:
    out, start = [], 0
    for n in sizes:
        out.append(start)
        start += n
    return out


def run_step(mesh: Any, step: Step, local: Any, async_op: bool):
    """Issue ``step`` on ``local``; return ``(work, finish)``: ``finish()`` gives the new local
    array once ``work`` (None for synchronous or local steps) is done."""
    xp = np if type(local) is np.ndarray else array_namespace(local)
    m, kind = step.mesh_dim, step.kind
    me = mesh.coordinate[m]
    if kind == "shard_local":
        d = step.dst.dim
        start = sum(step.dst_sizes[:me])
        index = (slice(None),) * d + (slice(start, start + step.dst_sizes[me]),)
        piece = xp.ascontiguousarray(local[index])
        return None, lambda: piece
    if kind == "partial_local":
        if step.dst.op == "sum" and me != 0:
            zeros = xp.zeros_like(local)
            return None, lambda: zeros
        return None, lambda: local
    # perm: index along mesh dimension m -> rank in the group
    group, perm, identity = mesh.group_info(m)
    if kind == "all_reduce":
        if step.how == "split":
            return _split_all_reduce(xp, group, perm, identity, me, step, local, async_op)
        array = local if step.how == "in place" else local.copy()
        work = dist.all_reduce(array, op=step.src.reduce_op, group=group, async_op=async_op)
        return work, lambda: array
    if kind == "all_gather":
        d, sizes = step.src.dim, step.src_sizes
        piece = local if not d and local.flags.c_contiguous else _front(xp, local, d)
        out = xp.empty((sum(sizes),) + piece.shape[1:], dtype=local.dtype)
        if identity and step.even:
            work = dist.all_gather(out, piece, group=group, async_op=async_op)
        else:
            views = [out[o : o + n] for o, n in zip(_offsets(sizes), sizes, strict=True)]
            outputs = [None] * len(views)
            for k, view in enumerate(views):
                outputs[perm[k]] = view
            work = dist.all_gather(outputs, piece, group=group, async_op=async_op)
        return work, lambda: _back(xp, out, d)
    if kind == "reduce_scatter":
        d, sizes = step.dst.dim, step.dst_sizes
        whole = local if not d and local.flags.c_contiguous else _front(xp, local, d)
        out = xp.empty((sizes[me],) + whole.shape[1:], dtype=local.dtype)
        op = step.src.reduce_op
        if identity and step.even:
            work = dist.reduce_scatter(out, whole, op=op, group=group, async_op=async_op)
        else:
            inputs = [None] * len(sizes)
            for k, (o, n) in enumerate(zip(_offsets(sizes), sizes, strict=True)):
                inputs[perm[k]] = whole[o : o + n]
            work = dist.reduce_scatter(out, inputs, op=op, group=group, async_op=async_op)
        return work, lambda: _back(xp, out, d)
    if kind == "all_to_all":
        return _all_to_all(xp, group, perm, me, step, local, async_op)
    raise AssertionError(f"unknown step {kind}")


def _split_all_reduce(xp, group, perm, identity, me, step: Step, local, async_op):
    """All-reduce without writing ``local``: a reduce-scatter of its flat chunks into this rank's
    chunk of a new array, then an all-gather of that chunk in place."""
    source = local.reshape(-1)
    out = xp.empty(local.shape, dtype=local.dtype)
    flat = out.reshape(-1)
    sizes = split_sizes(source.size, step.group_size)
    offsets = _offsets(sizes)
    mine = flat[offsets[me] : offsets[me] + sizes[me]]
    op = step.src.reduce_op
    if identity and len(set(sizes)) == 1:
        dist.reduce_scatter(mine, source, op=op, group=group)
        work = dist.all_gather(flat, mine, group=group, async_op=async_op)
    else:
        inputs, outputs = [None] * len(sizes), [None] * len(sizes)
        for k, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
            inputs[perm[k]], outputs[perm[k]] = source[o : o + n], flat[o : o + n]
        dist.reduce_scatter(mine, inputs, op=op, group=group)
        work = dist.all_gather(outputs, mine, group=group, async_op=async_op)
    return work, lambda: out


def _all_to_all(xp, group, perm, me, step: Step, local, async_op):
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
        sends = [(a - src_off[me], max(a, b) - src_off[me]) for a, b in zip(lo, hi, strict=True)]
        got = [
            max(0, min(src_off[k] + src_sizes[k], dst_off[me] + dst_sizes[me])
                - max(src_off[k], dst_off[me]))
            for k in range(p)
        ]  # fmt: skip
        along, shape = i, list(local.shape)
    else:
        sends = [(dst_off[k], dst_off[k] + dst_sizes[k]) for k in range(p)]
        got = list(src_sizes)
        along, shape = j, list(local.shape)
        shape[j] = dst_sizes[me]
    shape[i] = sum(got)
    # the new piece with dimension i first
    front = xp.empty((shape[i],) + tuple(n for d, n in enumerate(shape) if d != i), local.dtype)
    inputs, outputs = [None] * p, [None] * p
    start = 0
    for k in range(p):
        block = front[start : start + got[k]]
        start += got[k]
        part = local[(slice(None),) * along + (slice(*sends[k]),)]
        if i:
            part = xp.moveaxis(part, i, 0)
        if k == me:
            block[...] = part
            part = block
        else:
            part = xp.ascontiguousarray(part)
        inputs[perm[k]], outputs[perm[k]] = part, block
    work = dist.all_to_all(outputs, inputs, group=group, async_op=async_op)
    return work, lambda: _back(xp, front, i)


def execute(mesh: Any, plan: Plan, local: Any, async_op: bool = False):
    """Run every step of ``plan``; return ``(work, finish)`` as :func:`run_step` does (only the
    last collective runs in the background: each step needs the one before)."""
    steps = plan.steps
    for n, step in enumerate(steps):
        last = n == len(steps) - 1
        work, finish = run_step(mesh, step, local, async_op and last)
        if last:
            return work, finish
        local = finish()
    return None, lambda: local
