"""What every gradient clip shares (FSDP's over sharded gradients, tensor parallelism's over
split ones): the norm type's check, one gradient's part of the norm, and the scaling once the
parts are summed, by torch's formula."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import distributed as dist


def norm_exponent(norm_type: float) -> float:
    """``norm_type`` as a float p > 0 (``inf`` for the largest magnitude)."""
    p = float(norm_type)
    if not p > 0:
        raise ValueError(
            f"rank {dist.get_rank()}: clip_grad_norm_ takes norm_type > 0 or inf, got {norm_type}"
        )
    return p


def norm_part(grad: Any, p: float) -> Any:
    """``grad``'s part of the norm, where ``grad`` lives (no copy to the host): its largest
    magnitude for p = inf, else the sum of its magnitudes to the p, in float64."""
    magnitude = abs(grad.astype(np.float64))
    return magnitude.max() if math.isinf(p) else (magnitude**p).sum()


def scale_to_norm(grads: list[Any], total: float, p: float, max_norm: float) -> float:
    """Scale every gradient by ``max_norm / (norm + 1e-6)`` when the norm that ``total`` (the
    parts combined) gives exceeds ``max_norm``; returns that norm, as torch does."""
    norm = total if math.isinf(p) else total ** (1.0 / p)
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for g in grads:
            g *= coefficient
    return norm
