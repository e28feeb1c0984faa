"""How a tensor-parallel layer's parameters are cut: each rank keeps its piece along one
dimension (each block alike, for a fused projection), recorded on the parameter as
``tp_layout``; ``full_parameter`` puts one back together. A parameter shared by two layers
(a head tied to the token embedding) is cut once, and only the same way."""

from __future__ import annotations

from typing import Any

from ... import distributed as dist
from ...dtensor import Shard, from_local
from ...dtensor.layout import split_sizes
from ...mesh import DeviceMesh
from ...nn.module import Parameter, array_namespace


def rank_text(mesh: DeviceMesh) -> str:
    return f"rank {dist.get_rank()}"


def rank_span(length: int, mesh: DeviceMesh) -> slice:
    """This rank's part of ``length`` entries by the array_split rule (5 over 4: 2, 1, 1, 1)."""
    sizes, me = split_sizes(length, mesh.size()), mesh.get_local_rank()
    start = sum(sizes[:me])
    return slice(start, start + sizes[me])


def piece_of(array: Any, dim: int, mesh: DeviceMesh, chunks: int) -> Any:
    """This rank's part of ``array`` along ``dim``: of each of ``chunks`` equal blocks (q, k and v
    of a fused projection), the array_split piece."""
    xp = array_namespace(array)
    block = array.shape[dim] // chunks
    pieces = []
    for c in range(chunks):
        span = rank_span(block, mesh)
        index = (slice(None),) * dim + (slice(c * block + span.start, c * block + span.stop),)
        pieces.append(array[index])
    return xp.ascontiguousarray(xp.concatenate(pieces, axis=dim))


def check_splits(mesh: DeviceMesh, splits: list[tuple[Parameter, int, int]]) -> None:
    """Refuse, before a style changes anything, to split a parameter that a layer sharing it
    split, or is about to split in the same style, another way. ``splits``: the (parameter,
    dimension, blocks) the style will cut."""
    planned: dict[int, tuple] = {}
    for param, dim, blocks in splits:
        layout = getattr(param, "tp_layout", None)
        other = layout[:3] if layout is not None else planned.get(id(param))
        if other is not None and other != (mesh, dim, blocks):
            raise ValueError(
                f"{rank_text(mesh)}: a parameter shared by two layers is split along "
                f"dimension {other[1]} over {other[0]!r} by one and along dimension {dim} over "
                f"{mesh!r} by the other; shared weights are split alike (the token embedding "
                "row-wise, the head column-wise)"
            )
        planned[id(param)] = (mesh, dim, blocks)


def shard_parameter(param: Parameter, dim: int, mesh: DeviceMesh, chunks: int = 1) -> None:
    """Keep this rank's piece of ``param`` along ``dim`` (checked by :func:`check_splits`).
    A parameter that a layer sharing it split already (a head tied to the token embedding:
    both keep this rank's rows) stays as it is."""
    if getattr(param, "tp_layout", None) is not None:
        return
    param.tp_layout = (mesh, dim, chunks, tuple(param.data.shape))
    param.data = piece_of(param.data, dim, mesh, chunks)
    param.grad = None


def full_parameter(param: Parameter, grad: bool = False) -> Any:
    """The whole parameter (or its gradient) on every rank, from the pieces of a tensor-parallel
    layer; a parameter that is not split comes back as it is."""
    if getattr(param, "sharded_by_fsdp", False) and getattr(param, "tp_layout", None) is not None:
        raise ValueError(
            f"rank {dist.get_rank()}: full_parameter of a tensor-parallel piece that FSDP shards "
            "(its .data holds rows of the piece); save pluribus.parallel.get_model_state_dict "
            "with pluribus.checkpoint and read it back whole (checkpoint.read_whole)"
        )
    local = param.grad if grad else param.data
    layout = getattr(param, "tp_layout", None)
    if layout is None:
        return local
    mesh, dim, chunks, shape = layout
    xp = array_namespace(local)
    block = shape[dim] // chunks
    mine = local.shape[dim] // chunks
    parts = []
    for c in range(chunks):
        index = (slice(None),) * dim + (slice(c * mine, (c + 1) * mine),)
        piece_shape = list(shape)
        piece_shape[dim] = block
        piece = xp.ascontiguousarray(local[index])
        dt = from_local(piece, mesh, [Shard(dim)], run_check=False, shape=piece_shape)
        parts.append(dt.full_tensor())
    return xp.concatenate(parts, axis=dim)
