"""Gradient clipping over sharded gradients: each rank's part of the norm from its own rows,
summed (or, for the infinity norm, maxed) over the shard group only. Replicated copies (the
replicate dimension of hybrid sharding, NO_SHARD) hold the same rows and are not counted
again; that is what makes the norm equal the single-process one. The rows of a
tensor-parallel piece are one rank's part of a larger parameter: their part is then summed
over the tensor-parallel mesh too, and a replicated parameter's is not."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ... import distributed as dist
from ..clip_norm import norm_exponent, norm_part, scale_to_norm


def clip_grad_norm_(model: Any, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale every gradient by ``max_norm / (norm + 1e-6)`` when the total norm exceeds
    ``max_norm``; returns the total norm (of the gradients before clipping), as torch does.
    ``norm_type``: any p > 0, or ``inf``."""
    p = norm_exponent(norm_type)
    infinite = math.isinf(p)
    # per (shard group, tensor-parallel mesh): [shard group, tensor-parallel group, value]
    partial: dict[tuple, list[Any]] = {}
    grads, xp = [], np
    for unit in model.fsdp_units():
        xp = unit.xp  # where the group's backend takes its arrays
        group = unit.group if unit.n > 1 else None
        for piece in unit.pieces:
            layout = getattr(piece.param, "tp_layout", None)
            key = (id(group), None if layout is None else layout[0])
            split = None if layout is None else layout[0].get_group()
            entry = partial.setdefault(key, [group, split, 0.0])  # made alike on every rank
            g = piece.param.grad
            if g is None:
                continue
            grads.append(g)
            if g.size == 0:
                continue
            value = float(norm_part(g, p))
            entry[2] = max(entry[2], value) if infinite else entry[2] + value
    total = 0.0
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    for groups in partial.values():  # in the parameters' order: alike on every rank
        value = groups[2]
        for group in groups[:2]:
            if group is not None:
                buf = xp.asarray([value], dtype=np.float64)
                dist.all_reduce(buf, op=op, group=group)
                value = float(buf[0])
        total = max(total, value) if infinite else total + value
    return scale_to_norm(grads, total, p, max_norm)
