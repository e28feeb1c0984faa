"""Shared by the DTensor tests: a plugin that records every collective each rank issues."""

from __future__ import annotations

import threading
from collections import defaultdict

from pluribus import hookimpl


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
