"""The memory ledger: the bytes each rank holds for FSDP's parameters, gradients, optimizer
state and temporary buffers, counted from the arrays themselves (numpy has no allocator
statistics), with the peak seen at every gather, free and reduction.

A buffer is counted once however many views of it exist (a shard that views the full
parameters counts as the full parameters), in the first category that finds it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...nn.memory import arrays_in, base_buffer


@dataclass
class LedgerReport:
    """Bytes on this rank now and at the peak since the last reset. ``optimizer_state`` is
    counted when the report is made (it does not change size after the first step), so
    ``peak_total`` is the peak of the rest plus it."""

    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int  # gathered parameters, all-gathers in flight, the send buffers
    peak_parameters: int
    peak_gradients: int
    peak_buffers: int
    peak_total: int

    @property
    def steady(self) -> int:
        """Parameters, gradients and optimizer state: what the ZeRO formulas count."""
        return self.parameters + self.gradients + self.optimizer_state

    def __str__(self) -> str:
        mib = 2**20
        return (
            f"parameters {self.parameters / mib:.2f} MiB, gradients {self.gradients / mib:.2f} "
            f"MiB, optimizer state {self.optimizer_state / mib:.2f} MiB, buffers "
            f"{self.buffers / mib:.2f} MiB; peak {self.peak_total / mib:.2f} MiB"
        )


class MemoryLedger:
    """Counts the buffers of a root's units and their send buffers (held from their first
    use on); ``sample()`` updates the peaks."""

    def __init__(self, units: list[Any], send_buffers: Any = None):
        self.units = units
        self.send_buffers = send_buffers
        self.reset_peak()

    def reset_peak(self) -> None:
        self.peak = {"parameters": 0, "gradients": 0, "buffers": 0, "total": 0}

    def _count(self, *extra: Any) -> dict[str, int]:
        seen: set[int] = set()

        def add(arrays: Iterable[Any]) -> int:
            total = 0
            for array in arrays:
                if array is None:
                    continue
                root = base_buffer(array)
                if id(root) not in seen:
                    seen.add(id(root))
                    total += int(root.nbytes)
            return total

        units = self.units
        parameters = add(a for u in units for a in (u.full_flat, u.shard_flat))
        parameters += add(v for u in units for v in u.shard_views)
        gradients = add(u.full_grad_flat for u in units)
        gradients += add(p.param.grad for u in units for p in u.pieces)
        gradients += add(a for u in units for a in arrays_in(u._stash))
        gradients += add(u._reduction[1] for u in units if u._reduction is not None)
        buffers = add(self.send_buffers.allocated if self.send_buffers is not None else ())
        buffers += add(u.compute_flat for u in units)
        buffers += add(a for u in units if u._gather is not None for a in arrays_in(u._gather[1:]))
        buffers += add(u._reduction[2] for u in units if u._reduction is not None)
        buffers += add(arrays_in(extra))
        return {"parameters": parameters, "gradients": gradients, "buffers": buffers}

    def sample(self, *extra: Any) -> None:
        now = self._count(*extra)
        now["total"] = sum(now.values())
        for key, value in now.items():
            self.peak[key] = max(self.peak[key], value)

    def report(self, optimizer: Any = None) -> LedgerReport:
        now = self._count()
        state = 0
        if optimizer is not None:
            seen: set[int] = set()
            for array in arrays_in(list(optimizer.state)):
                root = base_buffer(array)
                if id(root) not in seen and getattr(root, "ndim", 0) > 0:
                    seen.add(id(root))
                    state += int(root.nbytes)
        self.sample()
        return LedgerReport(
            now["parameters"],
            now["gradients"],
            state,
            now["buffers"],
            self.peak["parameters"],
            self.peak["gradients"],
            self.peak["buffers"],
            self.peak["total"] + state,
        )
