"""The send buffers of FSDP's collectives, shared by the units of one root and reused at every
step.

The all-gather's input (this rank's rows) and the reduce-scatter's input (the packed full
gradients) are the arrays the peers read. Taken from :func:`pluribus.empty_symmetric`, at the
same offset on every rank, they let gloo on one host run both collectives zero-copy: each rank
reads its peers' inputs straight out of their memory instead of through a copy into the arena.
An allocation is a collective call and a shared segment, so the buffers are made once, when
the root first runs (where every rank is known to be at the same point: it has just checked
that all wrap the same units), each sized for the largest unit of its group and dtype, and then
lent out again at every collective. As many are made as can be in flight: one all-gather (the
prefetch is started after the previous one is waited for) and one reduce-scatter (two when a
unit keeps its full gradients: ZeRO-1 reduces them two at a time). A call that finds them all
lent (a user's ``unshard`` of many units at once) gets a plain array and the copying path.

Cupy units allocate per call, as before: symmetric memory is host memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...symmetric import empty_symmetric


class SendBuffers:
    """The reusable send buffers of one root's units."""

    def __init__(self, units: list[Any]):
        #: (kind, group, dtype) -> [elements of each buffer, how many]
        needs: dict[tuple, list[int]] = {}
        for unit in units:
            if unit.n == 1 or unit.xp is not np or not unit.pieces:
                continue
            in_flight = 2 if unit.rules.keeps_full_gradients else 1
            for key, size, count in (
                (("all_gather", unit.group, np.dtype(unit.compute_dtype)), unit.segment, 1),
                (
                    ("reduce_scatter", unit.group, np.dtype(unit.reduce_dtype)),
                    sum(unit.counts),
                    in_flight,
                ),
            ):
                need = needs.setdefault(key, [0, 0])
                need[0], need[1] = max(need[0], size), max(need[1], count)
        self.sizes = {key: size for key, (size, _) in needs.items()}
        self.allocated: list[np.ndarray] = []  # for the ledger
        self._free: dict[tuple, list[np.ndarray]] = {}
        for (kind, group, dtype), (size, count) in needs.items():  # the same order everywhere
            for _ in range(count):
                buffer = empty_symmetric(size, dtype, group)
                self.allocated.append(buffer)
                self._free.setdefault((kind, group, dtype), []).append(buffer)
        self._lent: dict[int, tuple[tuple, np.ndarray, np.ndarray]] = {}

    def take(self, kind: str, unit: Any, dtype: Any, n: int) -> Any:
        """``n`` elements of ``dtype`` for ``unit``'s ``kind`` of collective (the start of a
        free buffer, or a plain array where none is); give it back once the collective is
        waited for."""
        if unit.xp is not np:
            return unit.xp.empty(n, dtype)
        key = (kind, unit.group, np.dtype(dtype))
        free = self._free.get(key)
        if not free or n > self.sizes[key]:  # all lent, or another dtype (full state dicts)
            return np.empty(n, dtype)
        whole = free.pop()
        view = whole[:n]
        self._lent[id(view)] = (key, whole, view)
        return view

    def give_back(self, view: Any) -> None:
        """Return what :meth:`take` lent (a plain array is simply dropped)."""
        lent = self._lent.pop(id(view), None)
        if lent is not None:
            self._free[lent[0]].append(lent[1])

    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.allocated)
