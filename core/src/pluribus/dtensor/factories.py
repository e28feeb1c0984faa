"""torch's DTensor factories (``zeros``, ``ones``, ``empty``, ``full``): each rank allocates
only its own piece, so a tensor too large for one rank can be made split. The pieces are what
:func:`~pluribus.dtensor.distribute_tensor` would cut from the whole array (a ``Partial("sum")``
keeps the value on the first rank of its mesh dimension and zeros elsewhere), without any
whole array or communication. The arrays are numpy on a "cpu" mesh and cupy on a "cuda" one.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import distributed as dist
from ..mesh import DeviceMesh
from .api import DTensor
from .layout import default_layout, normalize_placements
from .placements import Partial, Placement, Replicate


def _shape(size: tuple) -> tuple[int, ...]:
    """torch's ``*size``: integers, or one sequence of them."""
    if len(size) == 1 and isinstance(size[0], (list, tuple)):
        size = tuple(size[0])
    try:  # a bool is no size, though operator.index takes it
        shape = tuple(operator.index(n) for n in size if not isinstance(n, (bool, np.bool_)))
    except TypeError:
        shape = None
    if shape is not None and len(shape) != len(size):
        shape = None
    if shape is None or any(n < 0 for n in shape):
        raise ValueError(
            f"rank {dist.get_rank()}: a DTensor's size is non-negative integers, got {size!r}"
        )
    return shape


def _make(
    size: tuple,
    fill: Any,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    dtype: Any,
    what: str,
) -> DTensor:
    """The DTensor of ``size`` whose every element is ``fill`` (None: uninitialised)."""
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"rank {dist.get_rank()}: {what} needs device_mesh= (a DeviceMesh), got {device_mesh!r}"
        )
    mesh, shape = device_mesh, _shape(size)
    dtype = np.dtype(np.float32 if dtype is None else dtype)  # torch's default dtype
    if fill is not None:
        if np.ndim(fill) != 0:
            raise ValueError(
                f"rank {dist.get_rank()}: {what}'s fill value is one number, got an array of "
                f"shape {np.shape(fill)}"
            )
        try:  # a value the dtype cannot hold fails here, by name
            np.array(fill, dtype=dtype)
        except (OverflowError, ValueError, TypeError) as e:
            raise ValueError(
                f"rank {dist.get_rank()}: {what} cannot fill {dtype} with {fill!r}: {e}"
            ) from None
    if placements is None:
        placements = (Replicate(),) * mesh.ndim
    targets = normalize_placements(placements, len(shape), mesh.shape, dist.get_rank(), dtype)
    layout = default_layout(shape, targets, mesh.shape)
    if mesh.device_type == "cuda":
        import cupy as xp
    else:
        xp = np
    local = layout.local_shape(mesh.coordinate)
    zero = any(  # the terms of a sum: the value once, on the first rank of the mesh dimension
        isinstance(p, Partial) and p.op == "sum" and mesh.coordinate[m] != 0
        for m, p in enumerate(targets)
    )
    if zero:
        piece = xp.zeros(local, dtype)
    elif fill is None:
        piece = xp.empty(local, dtype)
    else:
        piece = xp.full(local, fill, dtype)
    return DTensor(piece, mesh, layout)


def zeros(
    *size: Any,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    dtype: Any = np.float32,
) -> DTensor:
    """A DTensor of zeros (``zeros(4, 8, device_mesh=mesh, placements=[Shard(0)])``)."""
    return _make(size, 0, device_mesh, placements, dtype, "zeros")


def ones(
    *size: Any,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    dtype: Any = np.float32,
) -> DTensor:
    """A DTensor of ones."""
    return _make(size, 1, device_mesh, placements, dtype, "ones")


def empty(
    *size: Any,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    dtype: Any = np.float32,
) -> DTensor:
    """A DTensor whose pieces are uninitialised (a ``Partial("sum")`` piece off the first rank
    is zeros, so that the sum is the first rank's values)."""
    return _make(size, None, device_mesh, placements, dtype, "empty")


def full(
    size: Sequence[int],
    fill_value: Any,
    *,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    dtype: Any = np.float32,
) -> DTensor:
    """A DTensor whose every element is ``fill_value``."""
    return _make((size,), fill_value, device_mesh, placements, dtype, "full")
