"""Symmetric memory: arrays that every rank of a group allocates together and that the group's
backend can read on every peer.

A collective on ordinary arrays must first copy each rank's input somewhere its peers can read
it (a shared-memory slot, a socket). When the arrays themselves live in memory every peer has
mapped, that copy goes: gloo's all-reduce on one host then reduces each rank's part straight
out of the peers' arrays (about 2.5 bytes of memory traffic per byte instead of 4). The idea
and the name are the field's: NCCL's ``ncclMemAlloc`` with window registration, torch's
``torch.distributed._symmetric_memory``, MPI's ``MPI_Win_allocate_shared``.

Allocation is not a collective operation of :data:`~pluribus.operations.OPERATIONS` (it moves no
data, and nothing that wraps or records operations has anything to say about it): it is an
optional backend method, :meth:`pluribus.Backend.empty_symmetric`, whose default is
``np.empty``, so code may always call :func:`empty_symmetric`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import distributed as dist


def empty_symmetric(shape: Any, dtype: Any = np.float32, group: Any = None) -> np.ndarray:
    """An uninitialised numpy array of ``shape`` and ``dtype`` that the group's backend can read
    on every rank of ``group``, so that collectives on it (gloo's in-place all-reduce among the
    ranks of one host) skip copying it first. Where the backend cannot do that (other hosts,
    threads, mpi, a group of one) it is a plain ``np.empty``: results are the same either way.

    A collective call: every rank of the group calls it, in the same order as its collectives,
    with the same shape and dtype (checked on every rank before anything is allocated). The
    array keeps its memory for as long as it or a view of it lives; collectives run zero-copy
    when every rank passes the array (or the same slice of it) allocated by the same call.
    """
    g = dist._group(group)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
    dtype = np.dtype(dtype)
    if any(n < 0 for n in shape):
        raise ValueError(f"rank {g.global_rank}: empty_symmetric got a negative shape {shape}")
    _check_same_everywhere(g, shape, dtype)
    backend = g.backends.get("cpu")
    if backend is None or g.size == 1:
        return np.empty(shape, dtype)
    work = g.submit(
        lambda: backend.empty_symmetric(shape, dtype),
        False,
        f"empty_symmetric({shape}, {dtype}) on group {g.name!r}",
    )
    array = work.result()
    if array.shape != shape or array.dtype != dtype:  # a backend's bug, not the user's
        raise TypeError(
            f"rank {g.global_rank}: the {backend.name} backend's empty_symmetric returned "
            f"{array.shape} {array.dtype} for {shape} {dtype}"
        )
    return array


def _check_same_everywhere(g: Any, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Refuse, on every rank, a call whose shape or dtype differs between ranks, naming them."""
    mine = [list(shape), dtype.str]
    everyone = dist.all_gather_object(mine, group=g)
    if all(theirs == everyone[0] for theirs in everyone):
        return
    asked = "; ".join(
        f"rank {g.ranks[i]}: {tuple(s)} {np.dtype(d)}" for i, (s, d) in enumerate(everyone)
    )
    raise ValueError(
        f"rank {g.global_rank}: empty_symmetric on group {g.name!r} needs the same shape and "
        f"dtype on every rank, but they asked for {asked}; nothing was allocated. Allocate the "
        "same array everywhere (pad the smaller ones)"
    )
