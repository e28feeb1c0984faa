"""What crosses a tensor-parallel layer's boundary: an activation or a gradient, this rank's
piece in one placement, redistributed to another along the mesh (one collective, through
DTensor)."""

from __future__ import annotations

from typing import Any

from ...dtensor import Placement, Shard, from_local
from ...dtensor.layout import split_sizes
from ...mesh import DeviceMesh
from .pieces import rank_text


def move(
    array: Any,
    mesh: DeviceMesh,
    src: Placement,
    dst: Placement,
    features: int | None,
    rows: int | None = None,
) -> Any:
    """``array`` (this rank's piece in ``src``) redistributed to ``dst`` along the mesh.
    A ``Shard`` source's whole size along its dimension: ``rows`` when the caller knows it, else
    ``features`` for the last dimension; with neither, the ranks exchange their pieces' shapes
    to learn the sizes (uneven ones included: never guessed)."""
    if src == dst:
        return array
    return locate(array, mesh, src, features, rows).redistribute(placements=[dst]).to_local()


def locate(
    array: Any, mesh: DeviceMesh, src: Placement, features: int | None, rows: int | None = None
) -> Any:
    """``array`` (this rank's piece in ``src``) as a DTensor, nothing moved yet: what
    :func:`move` redistributes. Its sizes exchanged and checked where they are not known, so a
    caller moving several values can refuse any of them before it moves one."""
    shape = list(array.shape)
    if isinstance(src, Shard):
        dim = src.dim % len(shape)
        whole = rows if rows is not None else features if dim == len(shape) - 1 else None
        if whole is None:
            dt = from_local(array, mesh, [src])  # the same sizes on every rank: refused alike
            sizes = dt.layout.sizes[0]
            if sizes != split_sizes(sum(sizes), len(sizes)):
                raise ValueError(
                    f"{rank_text(mesh)}: a tensor-parallel layer takes an input sharded along "
                    f"dimension {src.dim} in array_split pieces, which its output and gradient "
                    f"keep: {split_sizes(sum(sizes), len(sizes))} rows for the ranks of the "
                    f"mesh, got {sizes}"
                )
            return dt
        shape[dim] = whole
    return from_local(array, mesh, [src], run_check=False, shape=shape)


def global_rows(shape: tuple[int, ...], placement: Placement) -> int | None:
    """The global size along ``placement``'s sharded dimension of an array of global
    ``shape`` (None for a placement that shards nothing)."""
    return shape[placement.dim] if isinstance(placement, Shard) else None
