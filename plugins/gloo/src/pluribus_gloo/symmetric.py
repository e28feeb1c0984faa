"""Symmetric allocations: one shared-memory segment per :func:`pluribus.empty_symmetric` call on a
group with an arena, holding every member's array, and the registry that tells a collective
whether an array lies in one.

Member ``j``'s array starts at ``j * stride`` (page-aligned) in the segment, and every member maps
the whole segment, so each can read every peer's array at the same offset in its own mapping.
The segment is created by the group's rank 0 and named through the group's store, as the
arena's (:func:`pluribus_gloo.arena.open_arena`): between two barriers on the arena (which keep
its timeout and dead-peer promises) every member maps it, then it is unlinked, so it never
outlives the processes. A member that also learnt the name unlinks it too, in case rank 0 died
before it could. When any member fails to map it, every member gets a plain ``np.empty``.

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

from . import shm, wire

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
    key = f"symmetric/{backend.symmetric_allocations}"
    store, timeout, rank = backend.store, backend.timeout, arena.rank
    name, segment = "", None
    try:
        if rank == 0:
            try:
                name, segment = shm.create_mapping(total, reserve=True)
            except OSError as exc:
                log.info("gloo: cannot create %d bytes of symmetric memory (%s)", total, exc)
            store.set(f"{key}/name", name)
        _barrier(backend)  # the name is in the store
        if rank != 0:
            name = store.get(f"{key}/name", timeout).decode()
            if name:
                segment = shm.map_if_possible(name, total, "symmetric memory")
        store.set(f"{key}/mapped/{rank}", "1" if segment is not None else "0")
        _barrier(backend)  # every member has mapped it, or failed to
    except BaseException:
        if rank != 0 and not name:  # rank 0 may have died holding the name
            try:
                name = store.get(f"{key}/name", 0.5).decode()
            except Exception:
                pass
        if segment is not None:
            segment.close()
        raise
    finally:
        if name:
            shm.unlink(name)
    mapped = [store.get(f"{key}/mapped/{j}", timeout) == b"1" for j in range(arena.size)]
    if not all(mapped):
        if segment is not None:
            segment.close()
        return np.empty(shape, dtype)
    array = np.frombuffer(segment, dtype=dtype, count=math.prod(shape), offset=rank * stride)
    start = array.__array_interface__["data"][0]
    allocation = Allocation(
        backend.symmetric_allocations, arena, stride, start, start + nbytes, segment
    )
    _register(allocation, segment)
    return array.reshape(shape)


def _barrier(backend) -> None:
    backend._arena_call(wire.BARRIER, np.dtype(np.uint8), None, 0)
    backend.arena.sync()
