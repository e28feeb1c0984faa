"""Shared by the DTensor tests: a plugin that records every collective each rank issues (and
a context that registers it), a hypothesis strategy of (mesh shape, global shape,
placements, dtype) cases, and the errors of a list of bad calls."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

import pluribus as pb
from hypothesis import strategies as st
from pluribus import hookimpl
from pluribus.dtensor import Partial, Replicate, Shard

MESHES = [(1,), (3,), (2, 2), (2, 1, 2)]


def _placement(draw, ndim: int):
    kind = draw(st.sampled_from(["shard", "replicate", "partial"]))
    if kind == "shard" and ndim:
        return Shard(draw(st.integers(0, ndim - 1)))
    if kind == "partial":
        return Partial(draw(st.sampled_from(["sum", "avg", "max"])))
    return Replicate()


@st.composite
def layout_cases(
    draw, dtypes=("float32", "float64", "int64"), largest: int = 5, favour_shards: bool = False
):
    """A mesh shape (up to 4 ranks), a global shape of up to 3 dimensions (sizes 0 to
    ``largest``, so smaller than the mesh too), valid placements for both, and a dtype. With
    ``favour_shards``, half the cases shard some dimension along the first mesh dimension."""
    mesh = draw(st.sampled_from(MESHES))
    shape = tuple(draw(st.lists(st.integers(0, largest), max_size=3)))
    placements, used = [], set()
    for _ in mesh:
        p = _placement(draw, len(shape))
        if isinstance(p, Shard) and p.dim in used:
            p = Replicate()  # a tensor dimension is sharded by one mesh dimension only
        if isinstance(p, Shard):
            used.add(p.dim)
        placements.append(p)
    ops = {p.op for p in placements if isinstance(p, Partial)}
    if len(ops) > 1:  # Partial ops whose order matters are not mixed
        placements = [Replicate() if isinstance(p, Partial) else p for p in placements]
    free = [d for d in range(len(shape)) if Shard(d) not in placements[1:]]
    if favour_shards and free and draw(st.booleans()):
        placements[0] = Shard(draw(st.sampled_from(free)))
    dtype = draw(st.sampled_from(dtypes))
    if dtype == "int64":  # an average of integers is refused
        placements = [Partial() if p == Partial("avg") else p for p in placements]
    return mesh, shape, placements, dtype


def _nbytes(arrays) -> int:
    return sum(int(a.nbytes) for a in arrays if a is not None)


class CountingPlugin:
    """Wraps the per-call collective hooks (and binds nothing, so every call comes through)
    and records ``(collective, group ranks, bytes in, bytes out)`` per global rank."""

    def __init__(self):
        self.calls: dict[int, list[tuple]] = defaultdict(list)
        self.groups_created = 0
        self._lock = threading.Lock()

    def _record(self, group, name, nin, nout):
        self.calls[group.global_rank].append((name, tuple(group.ranks), nin, nout))

    def mark(self, rank: int) -> int:
        return len(self.calls[rank])

    def since(self, rank: int, mark: int) -> list[tuple]:
        return self.calls[rank][mark:]

    @hookimpl
    def pluribus_group_created(self, group):
        with self._lock:
            self.groups_created += 1

    @hookimpl(wrapper=True)
    def pluribus_all_reduce(self, group, array, op, async_op):
        self._record(group, "all_reduce", array.nbytes, array.nbytes)
        return (yield)

    @hookimpl(wrapper=True)
    def pluribus_all_reduce_into(self, group, array, output, op, async_op):
        self._record(group, "all_reduce_into", array.nbytes, output.nbytes)
        return (yield)

    @hookimpl(wrapper=True)
    def pluribus_all_gather(self, group, outputs, array, async_op):
        self._record(group, "all_gather", array.nbytes, _nbytes(outputs))
        return (yield)

    @hookimpl(wrapper=True)
    def pluribus_reduce_scatter(self, group, output, inputs, op, async_op):
        self._record(group, "reduce_scatter", _nbytes(inputs), output.nbytes)
        return (yield)

    @hookimpl(wrapper=True)
    def pluribus_all_to_all(self, group, outputs, inputs, async_op):
        self._record(group, "all_to_all", _nbytes(inputs), _nbytes(outputs))
        return (yield)

    @hookimpl(wrapper=True)
    def pluribus_broadcast(self, group, array, src, async_op):
        self._record(group, "broadcast", array.nbytes, array.nbytes)
        return (yield)


@contextlib.contextmanager
def counting_collectives(name: str):
    """A :class:`CountingPlugin` registered for the block (``name``: unique per test file)."""
    counting = CountingPlugin()
    manager = pb.get_plugin_manager()
    manager.register(counting, name=name)
    try:
        yield counting
    finally:
        manager.unregister(name=name)


def errors_of(calls: Iterable[Callable], typed: bool = False) -> list[str | None]:
    """Each call's error message (``"TypeError: ..."`` with ``typed``), None where it ran."""
    errors = []
    for call in calls:
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError, IndexError) as e:
            errors.append(f"{type(e).__name__}: {e}" if typed else str(e))
    return errors
