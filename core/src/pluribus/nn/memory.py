"""How many bytes a model holds, counted from its arrays (numpy has no allocator statistics).

``memory_report(model, optimizer)`` counts parameters, gradients, optimizer state and the
activations modules keep for backward (:meth:`Module.save_for_backward`). Arrays are counted
once per underlying buffer: a view counts as the array it views (the whole array, since the
view keeps it alive), so DDP's gradients count as its bucket buffers. ``peak_rss_bytes`` is the
process's high-water mark from the operating system, to cross-check the counts.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .module import Module


def base_buffer(array: Any) -> Any:
    """The array that owns ``array``'s memory (views count as their base), but not the buffer
    that array was made from: a symmetric array (:func:`pluribus.empty_symmetric`) is made
    from a memoryview of one shared segment holding every rank's array, and this rank holds
    only its own."""
    while getattr(array, "base", None) is not None and hasattr(array.base, "dtype"):
        array = array.base
    return array


def arrays_in(value: Any) -> Iterable[Any]:
    """The arrays inside ``value`` (an array, or tuples, lists and dicts of them)."""
    if hasattr(value, "nbytes") and hasattr(value, "shape"):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from arrays_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from arrays_in(item)


class _Counter:
    """Bytes of distinct buffers; a buffer counted in one category is not counted again."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def add(self, arrays: Iterable[Any]) -> int:
        total = 0
        for array in arrays:
            root = base_buffer(array)
            if id(root) not in self.seen:
                self.seen.add(id(root))
                total += int(root.nbytes)
        return total


@dataclass
class MemoryReport:
    """Bytes by category; ``total`` is their sum, ``peak_rss`` the process's high-water mark."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    peak_rss: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def __str__(self) -> str:
        mib = 2**20
        return (
            f"parameters {self.parameters / mib:.1f} MiB, gradients {self.gradients / mib:.1f} "
            f"MiB, optimizer state {self.optimizer_state / mib:.1f} MiB, activations "
            f"{self.activations / mib:.1f} MiB (total {self.total / mib:.1f} MiB; peak resident "
            f"{self.peak_rss / mib:.1f} MiB)"
        )


def memory_report(
    model: Module | Iterable[Module], optimizer: Any = None, include_peak_rss: bool = True
) -> MemoryReport:
    """Count the arrays ``model`` (one module or several: add the loss to count its saved
    probabilities) and ``optimizer`` hold right now. Call it between forward and backward to
    see the activations at their largest."""
    modules = [model] if isinstance(model, Module) else list(model)
    counter = _Counter()
    params = [p for m in modules for p in m.parameters()]
    parameters = counter.add(p.data for p in params)
    parameters += counter.add(b for m in modules for _, b in m.named_buffers())
    gradients = counter.add(p.grad for p in params if p.grad is not None)
    gradients += counter.add(p.grad_view for p in params if p.grad_view is not None)
    state = 0
    if optimizer is not None:
        state = counter.add(a for entry in optimizer.state for a in arrays_in(entry))
    activations = counter.add(
        a for m in modules for _, sub in m.named_modules() for a in arrays_in(sub._saved)
    )
    return MemoryReport(
        parameters, gradients, state, activations, peak_rss_bytes() if include_peak_rss else 0
    )


def peak_rss_bytes() -> int:
    """The process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
