"""torch's ``clip_grad_norm_`` for a tensor-parallel model: the norm of the whole gradients,
a split parameter's pieces counted once over its mesh."""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import distributed as dist
from ...mesh import DeviceMesh
from ...nn.module import array_namespace
from ..clip_norm import norm_exponent, norm_part, scale_to_norm


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> float:
    """torch's ``clip_grad_norm_`` for a tensor-parallel model (any ``pluribus.nn``
    parameters): the norm of the whole gradients, a split parameter's pieces summed (for the
    infinity norm, maxed) over its mesh, so that every rank scales by the same factor and the
    replicated parameters stay equal; returns that norm, of the gradients before clipping.
    Under DDP, call it after backward (the gradients are already averaged). Collective over
    each tensor-parallel mesh: every rank passes its parameters in the same order."""
    p = norm_exponent(norm_type)
    infinite = np.isinf(p)

    def combine(a: Any, b: Any) -> Any:
        return b if a is None else (max(a, b) if infinite else a + b)

    # (mesh of a split parameter or None, array library) -> the part of the norm, kept where
    # the gradients are: one copy to the host per library, not one per gradient
    parts: dict[tuple[DeviceMesh | None, Any], Any] = {}
    grads = []
    for param in parameters:
        if getattr(param, "sharded_by_fsdp", False):
            raise ValueError(
                f"rank {dist.get_rank()}: clip_grad_norm_ got a parameter that FSDP shards; "
                "use the FSDP model's own model.clip_grad_norm_(max_norm)"
            )
        g = param.grad
        if g is None:
            continue
        grads.append(g)
        xp = array_namespace(g)
        # an empty piece still takes part in its mesh's all-reduce
        part = xp.zeros((), np.float64) if g.size == 0 else norm_part(g, p)
        layout = getattr(param, "tp_layout", None)
        key = (None if layout is None else layout[0], xp)
        previous = parts.get(key)
        parts[key] = part if previous is None else (
            xp.maximum(previous, part) if infinite else previous + part
        )  # fmt: skip
    total = None
    for (mesh, _), part in parts.items():  # in the parameters' order: alike on every rank
        if mesh is not None:  # a split parameter's pieces: their parts over its mesh
            part = part.reshape(1).astype(np.float64)
            op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
            dist.all_reduce(part, op=op, group=mesh.get_group())
            part = part[0]
        total = combine(total, float(part))
    return scale_to_norm(grads, 0.0 if total is None else total, p, max_norm)
