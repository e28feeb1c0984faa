"""torch's DTensor factories (``zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn``):
each rank allocates only its own piece, so a tensor too large for one rank can be made split.
The pieces are what :func:`~pluribus.dtensor.distribute_tensor` would cut from the whole array
(a ``Partial("sum")`` keeps the value on the first rank of its mesh dimension and zeros
elsewhere), without any whole array or communication (but for agreeing on a random seed when
none is given). The arrays are numpy on a "cpu" mesh and cupy on a "cuda" one.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import distributed as dist
from ..arrays import bfloat16_dtype
from ..mesh import DeviceMesh
from . import random
from .api import DTensor
from .boxes import layout_box
from .layout import Layout, default_layout, normalize_placements
from .placements import Placement, Replicate


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


def _made(
    size: tuple,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    dtype: Any,
    what: str,
) -> tuple[DeviceMesh, Layout, np.dtype, Any]:
    """The checked arguments of a factory: mesh, layout, dtype and array namespace."""
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"rank {dist.get_rank()}: {what} needs device_mesh= (a DeviceMesh), got {device_mesh!r}"
        )
    mesh, shape = device_mesh, _shape(size)
    dtype = np.dtype(np.float32 if dtype is None else dtype)  # torch's default dtype
    if placements is None:
        placements = (Replicate(),) * mesh.ndim
    targets = normalize_placements(placements, len(shape), mesh.shape, dist.get_rank(), dtype)
    layout = default_layout(shape, targets, mesh.shape)
    if mesh.device_type == "cuda":
        import cupy as xp
    else:
        xp = np
    return mesh, layout, dtype, xp


def _dtensor(
    mesh: DeviceMesh, layout: Layout, dtype: np.dtype, xp: Any, make: Callable[[], Any]
) -> DTensor:
    """The DTensor whose piece ``make()`` gives; a ``Partial("sum")`` piece off the first rank
    of its mesh dimension is zeros instead (the terms of a sum: the value once)."""
    if layout.zero_term(mesh.coordinate):
        return DTensor(xp.zeros(layout.local_shape(mesh.coordinate), dtype), mesh, layout)
    return DTensor(make(), mesh, layout)


def _make(
    size: tuple,
    fill: Any,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    dtype: Any,
    what: str,
) -> DTensor:
    """The DTensor of ``size`` whose every element is ``fill`` (None: uninitialised)."""
    mesh, layout, dtype, xp = _made(size, device_mesh, placements, dtype, what)
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
    local = layout.local_shape(mesh.coordinate)
    if fill is None:
        return _dtensor(mesh, layout, dtype, xp, lambda: xp.empty(local, dtype))
    return _dtensor(mesh, layout, dtype, xp, lambda: xp.full(local, fill, dtype))


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


def _seed(seed: Any, mesh: DeviceMesh, xp: Any, what: str) -> int:
    """``seed`` checked; None: one drawn on the world's rank 0 and broadcast to every rank
    (torch syncs rank 0's generator the same way), so each such call draws new values."""
    if seed is not None:
        try:
            value = operator.index(seed)
        except TypeError:
            value = -1
        if isinstance(seed, (bool, np.bool_)) or not 0 <= value < 2**128:
            raise ValueError(
                f"rank {dist.get_rank()}: {what}'s seed is an integer in [0, 2**128) (Philox's "
                f"key), the same on every rank; got {seed!r}"
            )
        return value
    drawn = xp.zeros(1, np.int64)
    if dist.get_rank() == 0:
        drawn[0] = int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> np.uint64(1))
    dist.broadcast(drawn, 0)
    return int(drawn[0])


def _random(size, device_mesh, placements, dtype, seed, normal: bool, what: str) -> DTensor:
    mesh, layout, dtype, xp = _made(size, device_mesh, placements, dtype, what)
    if dtype.kind != "f" and dtype != bfloat16_dtype():  # bfloat16 counts as a float
        raise TypeError(
            f"rank {dist.get_rank()}: {what} draws floating-point values; got dtype {dtype} "
            f"(pass a float dtype, or draw a float DTensor and convert its pieces)"
        )
    seed = _seed(seed, mesh, xp, what)
    offsets, sizes = layout_box(layout, mesh.coordinate)
    return _dtensor(
        mesh,
        layout,
        dtype,
        xp,
        lambda: xp.asarray(random.piece(seed, layout.shape, offsets, sizes, dtype, normal)),
    )


def rand(
    *size: Any,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    dtype: Any = np.float32,
    seed: int | None = None,
) -> DTensor:
    """A DTensor of values uniform on [0, 1): the same global array from the same ``seed``
    whatever the mesh and placements (:mod:`pluribus.dtensor.random`); each rank draws only
    its own piece. ``seed=None`` draws one on rank 0 and broadcasts it (one collective)."""
    return _random(size, device_mesh, placements, dtype, seed, False, "rand")


def randn(
    *size: Any,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    dtype: Any = np.float32,
    seed: int | None = None,
) -> DTensor:
    """A DTensor of standard normal values, the same global array from the same ``seed``
    whatever the mesh and placements (as :func:`rand`)."""
    return _random(size, device_mesh, placements, dtype, seed, True, "randn")
