"""Whole tensors out of a sharded checkpoint: one safetensors file that any reader loads
(DeepSpeed's universal checkpoint idea, as one file), and a listing of what a checkpoint
holds."""

from __future__ import annotations

import json
import os

import numpy as np

from .commit import TMP_MARK
from .load import DataFiles, Destination, read_into
from .metadata import Metadata, read_metadata
from .planning import plan_reads
from .safetensors_io import as_bytes, encode_header, numpy_dtype


def read_tensor(path: str, meta: Metadata, key: str, files: DataFiles, verify: bool = True):
    """The whole tensor ``key`` as a numpy array, assembled from its chunks."""
    info = meta.tensors[key]
    full = np.empty(info.shape, numpy_dtype(info.dtype))
    box = ((0,) * len(info.shape), info.shape)
    read_into(Destination(key, info, [(full, plan_reads(info, box))]), files, meta, verify)
    return full


def read_whole(path: str | os.PathLike, verify: bool = True) -> dict:
    """Every tensor whole (numpy) and every value, by dotted key: for a caller that holds
    everything whole anyway (one process, DDP) and has no state dict to load into yet (an
    optimizer creates its state at its first step)."""
    path = os.fspath(path)
    meta = read_metadata(path)
    files = DataFiles(path)
    try:
        out: dict = {key: read_tensor(path, meta, key, files, verify) for key in meta.tensors}
    finally:
        files.close()
    out.update(meta.values)
    return out


def consolidate(path: str | os.PathLike, out: str | os.PathLike, verify: bool = True) -> None:
    """Write every tensor of checkpoint ``path`` whole into the safetensors file ``out``
    (one tensor in memory at a time); plain values go into its ``__metadata__`` as JSON."""
    path, out = os.fspath(path), os.fspath(out)
    meta = read_metadata(path)
    keys = sorted(meta.tensors)
    specs = [(k, numpy_dtype(meta.tensors[k].dtype), meta.tensors[k].shape) for k in keys]
    extra = {k: json.dumps(v) for k, v in meta.values.items()}
    extra.update({k: json.dumps({"per_rank": v}) for k, v in meta.rank_values.items()})
    tmp = f"{out}{TMP_MARK}{os.getpid()}"
    files = DataFiles(path)
    try:
        with open(tmp, "wb") as f:
            f.write(encode_header(specs, extra))
            for key in keys:
                array = read_tensor(path, meta, key, files, verify)
                if array.size:
                    f.write(as_bytes(array))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        files.close()
        if os.path.exists(tmp):
            os.remove(tmp)


def describe(path: str | os.PathLike, verify: bool = False) -> str:
    """A table of the checkpoint's tensors (shape, dtype, chunks, how they were saved) and
    values; with ``verify`` every byte is read and checked first."""
    path = os.fspath(path)
    meta = read_metadata(path)
    if verify:
        files = DataFiles(path)
        try:
            for key in meta.tensors:
                read_tensor(path, meta, key, files, True)
        finally:
            files.close()
    total = sum(info.nbytes for info in meta.tensors.values())
    lines = [
        f"{path}: saved by {meta.world_size} rank(s), {len(meta.tensors)} tensors "
        f"({total:,} bytes), {len(meta.values) + len(meta.rank_values)} values"
        + (", every checksum verified" if verify else ""),
        f"{'key':40} {'shape':>16} {'dtype':>9} {'chunks':>6}  saved as",
    ]
    for key, info in sorted(meta.tensors.items()):
        shape = "x".join(map(str, info.shape)) or "scalar"
        chunks = len(info.chunks)
        lines.append(f"{key:40} {shape:>16} {info.dtype:>9} {chunks:>6}  {info.saved_layout}")
    for key, value in sorted(meta.values.items()):
        lines.append(f"{key:40} = {json.dumps(value)[:80]}")
    for key, value in sorted(meta.rank_values.items()):
        lines.append(f"{key:40} = per rank {json.dumps(value)[:70]}")
    return "\n".join(lines)
