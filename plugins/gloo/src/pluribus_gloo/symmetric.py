"""Symmetric allocations: one shared-memory segment per :func:`pluribus.empty_symmetric` call on a
group with an arena, holding every member's array, and the registry that tells a collective
whether an array lies in one.

Member ``j``'s array starts at ``j * stride`` (page-aligned) in the segment, and every member maps
the whole segment, so each can read every peer's array at the same offset in its own mapping.
The segment's name is the arena's with the group's count of allocations appended, so every
member knows it without asking the store (nothing is written there, and a survivor can unlink
it even when rank 0 died having just created it). Rank 0 creates it; after a barrier on the
arena the others map it; a one-element all-reduce then tells every member whether all mapped
it (each syncs on the arena, so both keep its timeout and dead-peer promises), and every member
unlinks it, also when the call fails, so it never outlives the processes. When any member
fails to map it, every member gets a plain ``np.empty``.

The array a member gets is a view of its mapping and keeps it alive; the registry holds only a
weak reference, and forgets the allocation when the mapping goes.
"""

from __future__ import annotations

import bisect
import logging
import math
import mmap
import threading
import weakref

import numpy as np
from pluribus.types import ReduceOp

from . import shm

log = logging.getLogger("pluribus.gloo")

PAGE = mmap.PAGESIZE


class Allocation:
    """One member's record of a symmetric allocation: ``number`` is the same on every member
    (the group's count of allocations), ``start``/``end`` the addresses of this member's array."""

    __slots__ = ("number", "arena", "stride", "start", "end", "mapping")

    def __init__(self, number: int, arena, stride: int, start: int, end: int, mapping):
        self.number = number
        self.arena = arena
        self.stride = stride
        self.start = start
        self.end = end
        self.mapping = weakref.ref(mapping)

    def peer_arrays(self, data: np.ndarray, offset: int) -> list[np.ndarray]:
        """Every member's array at byte ``offset`` with the shape and dtype of ``data`` (this
        member's own being ``data``, which keeps the mapping alive), through this mapping."""
        whole = np.frombuffer(self.mapping(), dtype=np.uint8)
        n, mine = data.nbytes, self.arena.rank
        return [
            data if j == mine else whole[j * self.stride + offset :][:n].view(data.dtype)
            for j in range(self.arena.size)
        ]


_lock = threading.Lock()
#: the allocations of this process, sorted by ``start`` (replaced whole, read without the lock)
_table: tuple[list[int], list[Allocation]] = ([], [])


def locate(data: np.ndarray, arena) -> tuple[Allocation, int] | None:
    """The allocation of ``arena``'s group that holds all of ``data``, and ``data``'s byte
    offset in this member's array; None when there is none."""
    starts, allocations = _table
    if not starts:
        return None
    address = data.__array_interface__["data"][0]
    i = bisect.bisect_right(starts, address) - 1
    if i < 0:
        return None
    found = allocations[i]
    if found.arena is not arena or address + data.nbytes > found.end:
        return None
    return found, address - found.start


def _register(allocation: Allocation, mapping: mmap.mmap) -> None:
    global _table
    with _lock:
        starts, allocations = list(_table[0]), list(_table[1])
        i = bisect.bisect_left(starts, allocation.start)
        starts.insert(i, allocation.start)
        allocations.insert(i, allocation)
        _table = (starts, allocations)
    weakref.finalize(mapping, _forget, allocation)


def _forget(gone: Allocation) -> None:
    global _table
    with _lock:
        starts, allocations = list(_table[0]), list(_table[1])
        i = allocations.index(gone)
        del starts[i], allocations[i]
        _table = (starts, allocations)


def allocate(backend, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``backend``'s :meth:`~pluribus.Backend.empty_symmetric`: every member calls it in the
    group's collective order (the core runs it on the group's lane)."""
    arena = backend.arena
    nbytes = math.prod(shape) * dtype.itemsize
    if arena is None or nbytes == 0:
        return np.empty(shape, dtype)
    stride = -(-nbytes // PAGE) * PAGE
    total = stride * arena.size
    backend.symmetric_allocations += 1
    number = backend.symmetric_allocations
    name = f"{arena.name}-{number}"
    segment = None
    try:
        if arena.rank == 0:
            segment = _create(name, total)
        backend.barrier()  # the segment exists, or rank 0 could not make it
        if arena.rank != 0:
            segment = shm.map_if_possible(name, total, "symmetric memory")
        everyone = _all_mapped(backend, segment is not None)
    except BaseException:
        if segment is not None:
            segment.close()
        raise
    finally:
        shm.unlink(name)  # on every member: the survivors' job when rank 0 died
    if not everyone:
        if segment is not None:
            segment.close()
        return np.empty(shape, dtype)
    array = np.frombuffer(segment, dtype=dtype, count=math.prod(shape), offset=arena.rank * stride)
    start = array.__array_interface__["data"][0]
    _register(Allocation(number, arena, stride, start, start + nbytes, segment), segment)
    return array.reshape(shape)


def _create(name: str, nbytes: int) -> mmap.mmap | None:
    try:
        return shm.create_mapping(nbytes, reserve=True, name=name)[1]
    except OSError as exc:
        log.info("gloo: cannot create %d bytes of symmetric memory (%s)", nbytes, exc)
        return None


def _all_mapped(backend, mapped: bool) -> bool:
    """Whether every member mapped the segment (a one-element MIN all-reduce on the arena);
    once it returns, no member opens the segment's name any more."""
    flag = np.array([mapped], np.uint8)
    backend.all_reduce(flag, ReduceOp.MIN)
    return bool(flag[0])
