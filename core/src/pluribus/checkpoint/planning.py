"""Who writes which box at save, and which byte ranges each rank reads at load.

Writers are decided on one path, in :func:`.save.take_snapshot` and
:func:`.save.write_and_commit`:

- an array every rank holds whole is written by one rank (:func:`assign_replicated`);
- a DTensor piece, where its mesh can tell (:func:`writes_locally`): by its rank, or, when it
  is replicated along the mesh's Replicate dimensions, by one of those replicas
  (:func:`writes_dtensor_piece`; the others do not even copy it). FSDP's pieces end here;
- the pieces left, which saving ranks off their mesh may hold too (a tensor-parallel piece on
  ``mesh["tp"]`` under data parallelism), and every box of a
  :class:`~pluribus.dtensor.boxes.Pieces`, travel as boxes in the all-gather that agrees on
  the save's directory anyway, and each box several ranks hold is written by one of them
  (:func:`assign_shared_pieces`).

Each rank computes its reads at load from what it holds and the metadata alone. Neither adds a
planning round: at scale the rounds of a gather-plan-scatter protocol dominate save time.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtensor import DTensor, Replicate
from ..dtensor.boxes import Box, Pieces
from .metadata import Chunk, TensorInfo


def writes_dtensor_piece(key: str, tensor: DTensor) -> bool:
    """Whether this rank may write its piece: among the ranks that hold the same piece along
    the DTensor's own Replicate mesh dimensions, one, chosen by key so that replicas share the
    work, and the others skip even the snapshot copy. Only when every rank of the mesh saves
    (:func:`writes_locally`); copies off the mesh are :func:`assign_shared_pieces`'s."""
    mesh, coordinate = tensor.device_mesh, tensor.device_mesh.coordinate
    replicated = [m for m, p in enumerate(tensor.placements) if isinstance(p, Replicate)]
    if not replicated:
        return True
    sizes = [mesh.shape[m] for m in replicated]
    mine = int(np.ravel_multi_index([coordinate[m] for m in replicated], sizes))
    shard_dims = [m for m in range(mesh.ndim) if m not in replicated]
    piece = (
        int(
            np.ravel_multi_index(
                [coordinate[m] for m in shard_dims], [mesh.shape[m] for m in shard_dims]
            )
        )
        if shard_dims
        else 0
    )
    return (zlib.crc32(key.encode()) + piece) % math.prod(sizes) == mine


def writes_locally(
    key: str, tensor: DTensor, mesh_ranks: set[int], saving: set[int]
) -> bool | None:
    """Whether this rank writes its DTensor piece, as far as the DTensor's mesh (``mesh_ranks``,
    global) can tell: True or False when it can, None when a saving rank off the mesh may
    hold a copy, or when some of the mesh's replicas do not save (a sub-group's save) and so
    cannot pick one among themselves: then :func:`assign_shared_pieces` picks the writer
    among the holders. Deciding here keeps most pieces out of that exchange (FSDP's, whose mesh
    is the saving group)."""
    if mesh_ranks <= saving:  # every replica on the mesh saves
        if not writes_dtensor_piece(key, tensor):
            return False
        return True if saving <= mesh_ranks else None
    if saving <= mesh_ranks and not any(isinstance(p, Replicate) for p in tensor.placements):
        return True  # distinct pieces, and no copies off the mesh
    return None


def assign_replicated(sized_keys: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """A writer rank for each array every rank holds whole (DDP): the largest first, each to
    the least loaded rank, so that every rank computes the same answer and bytes are spread."""
    loads = [0] * world_size
    owner = {}
    for key, nbytes in sorted(sized_keys, key=lambda kn: (-kn[1], kn[0])):
        rank = loads.index(min(loads))
        owner[key] = rank
        loads[rank] += max(nbytes, 1)
    return owner


PieceBox = tuple[str, tuple[int, ...], tuple[int, ...]]  # (key, offsets, sizes)


def assign_shared_pieces(
    held: list[list[tuple[str, list[int], list[int], int]]], loads: list[int]
) -> dict[PieceBox, int]:
    """A writer rank for every DTensor box, from each rank's ``(key, offsets, sizes, nbytes)``
    (``held[rank]``) and the bytes each rank writes anyway (``loads``): a box one rank holds
    is its own; a box several hold (only exactly equal boxes are the same piece) goes, the
    largest first, to its least loaded holder. The DTensor's mesh cannot see replicas across
    meshes, so without this each data-parallel replica of a tensor-parallel piece would write
    it again (torch's DCP dedups its global plan the same way); every rank computes the same
    answer from the same gathered lists."""
    loads = list(loads)
    holders: dict[PieceBox, list[int]] = {}
    nbytes_of: dict[PieceBox, int] = {}
    for rank, boxes in enumerate(held):
        for key, offsets, extent, nbytes in boxes:
            box = (key, tuple(offsets), tuple(extent))
            holders.setdefault(box, []).append(rank)
            nbytes_of[box] = max(nbytes_of.get(box, 0), int(nbytes))
    writer = {}
    for box, ranks in holders.items():
        if len(ranks) == 1:
            writer[box] = ranks[0]
            loads[ranks[0]] += nbytes_of[box]
    shared = sorted(
        (b for b, ranks in holders.items() if len(ranks) > 1), key=lambda b: (-nbytes_of[b], b)
    )
    for box in shared:
        rank = min(holders[box], key=lambda r: (loads[r], r))
        writer[box] = rank
        loads[rank] += max(nbytes_of[box], 1)
    return writer


def covers_exactly(info: TensorInfo) -> bool:
    """Whether the chunks tile the global shape: inside it, volumes that add up, and no two
    that overlap (the coordinator drops duplicate boxes first; boxes of ``Pieces`` on two
    ranks may overlap and leave a hole of the same volume)."""
    total = 0
    for c in info.chunks:
        if any(o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, info.shape, strict=True)):
            return False
        total += math.prod(c.sizes)
    if total != math.prod(info.shape):
        return False
    # a sweep along the dimension with the most distinct offsets: near linear for a grid
    boxes = [(c.offsets, c.sizes) for c in info.chunks if math.prod(c.sizes)]
    if len(boxes) < 2 or not info.shape:
        return True
    d = max(range(len(info.shape)), key=lambda k: len({o[k] for o, _ in boxes}))
    boxes.sort(key=lambda b: b[0][d])
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1 :]:
            if ob[d] >= oa[d] + sa[d]:
                break
            if all(
                max(x, y) < min(x + m, y + n) for x, m, y, n in zip(oa, sa, ob, sb, strict=True)
            ):
                return False
    return True


@dataclass(frozen=True)
class Read:
    """Copy rows ``rows`` (along dimension 0) of ``chunk`` and, of those, ``source`` into
    ``target`` of the destination piece."""

    chunk: Chunk
    rows: tuple[int, int]
    source: tuple[slice, ...]
    target: tuple[slice, ...]


def plan_reads(info: TensorInfo, box: Box) -> list[Read]:
    """The reads that fill ``box`` of the global tensor from the saved chunks: for each chunk
    that overlaps it, only the rows of the chunk the overlap spans."""
    want_off, want_size = box
    reads = []
    for chunk in info.chunks:
        lo = [max(a, b) for a, b in zip(chunk.offsets, want_off, strict=True)]
        hi = [
            min(a + s, b + t)
            for a, s, b, t in zip(chunk.offsets, chunk.sizes, want_off, want_size, strict=True)
        ]
        if any(h <= low for low, h in zip(lo, hi, strict=True)) and lo:
            continue
        if not lo:  # a 0-d tensor: one chunk, one element
            reads.append(Read(chunk, (0, 1), (), ()))
            continue
        rows = (lo[0] - chunk.offsets[0], hi[0] - chunk.offsets[0])
        source = (slice(0, rows[1] - rows[0]),) + tuple(
            slice(low - c, h - c)
            for low, h, c in zip(lo[1:], hi[1:], chunk.offsets[1:], strict=True)
        )
        target = tuple(slice(low - w, h - w) for low, h, w in zip(lo, hi, want_off, strict=True))
        reads.append(Read(chunk, rows, source, target))
    return reads


def describe_layout(value: Any) -> str:
    """How a tensor was held when saved, for ``inspect``."""
    if isinstance(value, DTensor):
        return f"DTensor mesh {list(value.device_mesh.shape)} {list(value.placements)}"
    if isinstance(value, Pieces):
        return f"Pieces: {value.layout}" if value.layout else "Pieces: boxes per rank"
    return "whole on every rank"
