"""Loading in place, into whatever layout the caller holds now.

Each rank plans its reads from the metadata and its own state dict alone (no collective):
for every piece it holds, the saved chunks that overlap it and, of each, only the rows the
overlap spans. Rows that land in contiguous memory of the destination are read straight into
it (one ``preadv`` with scratch buffers for the ends of the first and last checksum blocks);
others go through a buffer. Every block read is checked against its CRC-32 unless
``verify=False``. Ranks exchange only their outcome, twice (after planning, after reading),
so that an error on one rank is raised on all of them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import distributed as dist
from ..dtensor import Partial
from ..dtensor.boxes import Box, dtensor_box, regrouped
from . import commit
from .checksums import aligned, first_bad_block
from .errors import CheckpointError
from .metadata import Metadata, TensorInfo, read_metadata
from .planning import Read, plan_reads
from .safetensors_io import Entry, numpy_dtype, read_header
from .state import DTENSOR, PIECES, VALUE, Leaf, flatten, is_cupy, restore_value


@dataclass
class Destination:
    """Where a key's bytes go on this rank: host arrays (in ``parts``: views of them, each
    with the reads that fill it), then (for cupy pieces and numpy scalars) what puts each
    host array where it belongs afterwards."""

    key: str
    info: TensorInfo
    parts: list[tuple[np.ndarray, list[Read]]]
    finish: list[Callable[[], None]] = field(default_factory=list)


def _boxes(leaf: Leaf, rank: int) -> tuple[tuple[int, ...], list[tuple[Any, Box]]]:
    """The global shape of ``leaf`` and the arrays this rank fills, each with its box: a
    DTensor's piece, a whole array, or each box of a :class:`~pluribus.dtensor.boxes.Pieces`."""
    value = leaf.value
    if leaf.kind == DTENSOR:
        if any(isinstance(p, Partial) for p in value.placements):
            raise ValueError(
                f"rank {rank}: state dict entry {leaf.key!r} is a DTensor with placements "
                f"{list(value.placements)}; a Partial tensor holds terms, not the value, so a "
                "load cannot fill it: load into a Replicate (or Shard) DTensor"
            )
        return tuple(value.shape), [(value.local_to_write(), dtensor_box(value))]
    if leaf.kind == PIECES:
        return value.shape, [(a, (offsets, tuple(a.shape))) for offsets, a in value.pieces]
    shape = tuple(np.shape(value))
    return shape, [(value, ((0,) * len(shape), shape))]


def _to_device(local: Any, host: np.ndarray) -> None:
    """Copy ``host`` into the cupy array ``local``: cupy's ``set`` takes a contiguous array
    only, and a box of ``Pieces`` may be a view of a larger one."""
    if local.flags.c_contiguous:
        local.set(host)
    else:
        import cupy

        local[...] = cupy.asarray(host)


def _destination(leaf: Leaf, info: TensorInfo, rank: int) -> Destination:
    shape, boxes = _boxes(leaf, rank)
    dtype = np.dtype(leaf.value.dtype)
    grouped, empty = shape != info.shape, ((0,) * len(shape), (0,) * len(shape))
    if (grouped and regrouped(empty, shape, info.shape) is None) or dtype.name != info.dtype:
        raise ValueError(
            f"rank {rank}: {leaf.key!r} is saved as {list(info.shape)} {info.dtype}, but the "
            f"state dict holds {list(shape)} {dtype.name}; load into an array of the saved "
            "global shape (or that shape with its first two dimensions merged, or the first "
            "split in equal blocks) and dtype, in any layout"
        )
    dest = Destination(leaf.key, info, [])
    for local, box in boxes:
        if is_cupy(local):
            host = np.empty(local.shape, dtype)
            dest.finish.append(lambda local=local, host=host: _to_device(local, host))
        elif isinstance(local, np.generic):
            host = np.empty((), dtype)
            dest.finish.append(lambda host=host: leaf.replace(host[()]))
        else:
            host = local
            if not host.flags.writeable:
                raise ValueError(
                    f"rank {rank}: {leaf.key!r} is a read-only array; load writes in place"
                )
        if not grouped:
            dest.parts.append((host, plan_reads(info, box)))
            continue
        # each view only adds a leading dimension of 1 (or takes one block): views, whatever
        # the host array's strides
        dest.parts += [
            (host[index].reshape(part[1]), plan_reads(info, part))
            for index, part in regrouped(box, shape, info.shape)
        ]
    return dest


def plan_load(
    state_dict: dict,
    meta: Metadata,
    rank: int,
    world_size: int,
    strict: bool,
    global_rank: int | None = None,
) -> tuple[list[Destination], list[tuple[Leaf, Any]]]:
    """This rank's reads and the plain values it takes, or ``ValueError`` for bad input.
    ``rank`` is the loading group's; errors name ``global_rank`` (the same by default)."""
    who = rank if global_rank is None else global_rank
    leaves = flatten(state_dict, who)
    keys = {leaf.key for leaf in leaves}
    missing = sorted(keys - meta.keys)
    unexpected = sorted(meta.keys - keys)
    if strict and (missing or unexpected):
        raise ValueError(
            f"rank {who}: the state dict and the checkpoint hold different keys: missing from "
            f"the checkpoint {missing}, in the checkpoint but not the state dict {unexpected}; "
            "pass strict=False to load the keys they share"
        )
    destinations, values = [], []
    for leaf in leaves:
        if leaf.key not in meta.keys:
            continue
        if leaf.kind == VALUE:
            if leaf.key in meta.values:
                values.append((leaf, meta.values[leaf.key]))
            elif leaf.key in meta.rank_values:
                per_rank = meta.rank_values[leaf.key]
                if len(per_rank) != world_size:
                    raise ValueError(
                        f"rank {who}: {leaf.key!r} was saved with a different value on each of "
                        f"{len(per_rank)} ranks and cannot be shared among {world_size}; "
                        "load it with the saving world size or keep it out of the state dict"
                    )
                values.append((leaf, per_rank[rank]))
            else:
                raise ValueError(
                    f"rank {who}: {leaf.key!r} is a plain value in the state dict but an array "
                    "in the checkpoint; pass an array of its saved shape"
                )
        elif leaf.key in meta.tensors:
            destinations.append(_destination(leaf, meta.tensors[leaf.key], who))
        else:
            raise ValueError(
                f"rank {who}: {leaf.key!r} is an array in the state dict but the checkpoint "
                f"holds a plain value for it ({meta.values.get(leaf.key)!r})"
            )
    return destinations, values


class DataFiles:
    """Open data files and their headers, checked against the metadata once per file."""

    def __init__(self, root: str):
        self.root = root
        self.open: dict[str, tuple[int, dict[str, Entry], int]] = {}

    def entry(self, key: str, read: Read, itemsize: int) -> tuple[int, Entry, str]:
        name = read.chunk.file
        path = os.path.join(self.root, name)
        if name not in self.open:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(
                    f"{path}: cannot open a data file of the checkpoint ({e.strerror}); it "
                    "holds part of " + repr(key)
                ) from None
            try:
                entries, _, size = read_header(fd, path)
            except (ValueError, KeyError) as e:
                os.close(fd)
                raise CheckpointError(f"{e}") from None
            self.open[name] = (fd, entries, size)
        fd, entries, size = self.open[name]
        entry = entries.get(read.chunk.name)
        expected = math.prod(read.chunk.sizes) * itemsize
        if entry is None or entry.end - entry.begin != expected:
            raise CheckpointError(
                f"{path}: tensor {read.chunk.name!r} of {key!r} is missing or of the wrong size "
                "in the file's header; the file does not belong to this checkpoint"
            )
        if entry.end > size:
            raise CheckpointError(
                f"{path}: {size} bytes, but tensor {read.chunk.name!r} of {key!r} ends at byte "
                f"{entry.end}: the file was truncated"
            )
        return fd, entry, path

    def close(self) -> None:
        for fd, _, _ in self.open.values():
            os.close(fd)
        self.open.clear()


def _read_exactly(fd: int, buffers: list[memoryview], offset: int, path: str) -> None:
    total = sum(len(b) for b in buffers)
    done = 0
    while done < total:
        n = os.preadv(fd, buffers, offset + done)
        if n == 0:
            raise CheckpointError(f"{path}: the file ends at byte {offset + done}: truncated")
        done += n
        if done < total:  # drop what was filled
            skip, rest = n, []
            for b in buffers:
                if skip >= len(b):
                    skip -= len(b)
                    continue
                rest.append(b[skip:])
                skip = 0
            buffers = rest


def read_into(dest: Destination, files: DataFiles, meta: Metadata, verify: bool) -> None:
    dtype = numpy_dtype(dest.info.dtype)
    for host, reads in dest.parts:
        for read in reads:
            _read_one(dest.key, host, read, dtype, files, meta, verify)


def _read_one(
    key: str,
    host: np.ndarray,
    read: Read,
    dtype: np.dtype,
    files: DataFiles,
    meta: Metadata,
    verify: bool,
) -> None:
    """Copy ``read``'s bytes of ``key`` into ``host`` (the destination's array or a view)."""
    block = meta.block_bytes
    fd, entry, path = files.entry(key, read, dtype.itemsize)
    sizes = read.chunk.sizes
    row_bytes = math.prod(sizes[1:]) * dtype.itemsize if sizes else dtype.itemsize
    chunk_bytes = entry.end - entry.begin
    begin, end = read.rows[0] * row_bytes, read.rows[1] * row_bytes
    start, stop = aligned(begin, end, block, chunk_bytes) if verify else (begin, end)
    target = host[read.target] if read.target else host
    whole_rows = all(
        s.start == 0 and s.stop == n for s, n in zip(read.source[1:], sizes[1:], strict=True)
    )
    direct = whole_rows and target.flags.c_contiguous and target.size > 0
    if direct:
        middle = memoryview(target.reshape(-1).view(np.uint8))
    else:
        staging = np.empty((read.rows[1] - read.rows[0], *sizes[1:]), dtype)
        middle = memoryview(staging.reshape(-1).view(np.uint8))
    segments = [memoryview(bytearray(begin - start)), middle, memoryview(bytearray(stop - end))]
    segments = [s for s in segments if len(s)]
    _read_exactly(fd, list(segments), entry.begin + start, path)
    if verify:
        bad = first_bad_block(segments, start, block, read.chunk.checksums, meta.checksum)
        if bad is not None:
            raise CheckpointError(
                f"{path}: checksum mismatch in tensor {read.chunk.name!r} of {key!r}, "
                f"chunk at offsets {list(read.chunk.offsets)} sizes {list(sizes)}, bytes "
                f"{bad * block}..{min((bad + 1) * block, chunk_bytes)} of the chunk: the file "
                "is corrupt; restore it or load an earlier checkpoint"
            )
    if not direct:
        if read.target:
            host[read.target] = staging[read.source]
        else:
            host[...] = staging.reshape(host.shape)


def _agree(group, error: str | None, what: str) -> None:
    """Raise on every rank if any rank failed."""
    if group is None:
        if error:
            raise CheckpointError(error)
        return
    errors = dist.all_gather_object(error, group=group)
    failed = [e for e in errors if e]
    if failed:
        rank = group.global_rank
        raise CheckpointError(f"rank {rank}: {what} failed: " + "; ".join(failed))


def load(
    state_dict: dict,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    verify: bool = True,
    process_group=None,
) -> None:
    """Fill ``state_dict`` in place from the checkpoint ``path``: arrays and DTensor pieces
    are written into, plain values replaced. The saved world size and layout do not matter.
    Checksums of every byte read are verified unless ``verify=False``."""
    path = os.fspath(path)
    group = None
    if dist.is_initialized():
        group = dist.get_default_group() if process_group is None else process_group
    rank = group.rank if group is not None else 0
    global_rank = group.global_rank if group is not None else 0
    error, plan = None, None
    try:
        commit.recover(path)
    except OSError:
        pass  # another rank put it back first
    try:
        meta = read_metadata(path)
        world = group.size if group is not None else 1
        plan = plan_load(state_dict, meta, rank, world, strict, global_rank)
    except (CheckpointError, TypeError, ValueError) as e:
        error = f"rank {global_rank}: {e}" if not str(e).startswith("rank ") else str(e)
    _agree(group, error, f"loading {path}")
    destinations, values = plan
    files = DataFiles(path)
    try:
        for dest in destinations:
            read_into(dest, files, meta, verify)
    except CheckpointError as e:
        error = f"rank {global_rank}: {e}"
    finally:
        files.close()
    _agree(group, error, f"loading {path}")
    for dest in destinations:
        for finish in dest.finish:
            finish()
    for leaf, value in values:
        leaf.replace(restore_value(leaf.value, value))
