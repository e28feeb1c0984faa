"""What the debugging plugins share: a description of one collective call, and a base class that
turns every collective hook into one ``around(call)`` generator.

Each debugging aid is a plugin with a ``wrapper=True`` implementation of every collective hook;
writing eleven near-identical wrappers three times would hide what each aid does, so
:class:`CollectiveWrapper` writes them once and a subclass implements only ``around``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Generator

from ..hookspecs import hookimpl
from ..work import FutureWork

#: Operations every rank of a group must call together (p2p ones are not checked across ranks).
COLLECTIVE_OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
)


def _nbytes(item: Any) -> int:
    if item is None:
        return 0
    if isinstance(item, list):
        return sum(_nbytes(x) for x in item)
    return int(getattr(item, "nbytes", 0))


def _sizes(items: list[Any] | None) -> list[int] | None:
    return None if items is None else [int(x.size) for x in items]


@dataclass
class CollectiveCall:
    """One call of a collective hook, described by plain values (no arrays kept)."""

    op: str
    group: Any
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    root: int | None = None
    reduce_op: str | None = None
    peer: int | None = None
    tag: int | None = None
    in_sizes: list[int] | None = None
    out_sizes: list[int] | None = None
    nbytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def collective(self) -> bool:
        return self.op in COLLECTIVE_OPS

    def describe(self) -> str:
        """``all_reduce(shape=(4,), dtype=float32, op=sum)``: how a rank's call reads in errors."""
        parts = []
        if self.shape is not None:
            parts.append(f"shape={self.shape}")
        if self.dtype is not None:
            parts.append(f"dtype={self.dtype}")
        if self.reduce_op is not None:
            parts.append(f"op={self.reduce_op}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.peer is not None:
            parts.append(f"peer={self.peer}")
        return f"{self.op}({', '.join(parts)})"

    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0


def describe_call(op: str, group: Any, **kw: Any) -> CollectiveCall:
    """Build a :class:`CollectiveCall` from a hook's keyword arguments."""
    array = kw.get("array")
    if array is None and op == "reduce_scatter":
        array = kw.get("output")
    if array is None and op == "all_to_all":
        array = (kw.get("inputs") or [None])[0]
    shape = tuple(int(n) for n in array.shape) if array is not None else None
    dtype = str(array.dtype) if array is not None else None
    reduce_op = kw["op"].value if kw.get("op") is not None else None
    root = kw.get("src", kw.get("dst")) if op in ("broadcast", "reduce", "gather", "scatter") else None
    peer = kw.get("dst", kw.get("src")) if op in ("send", "recv") else None
    in_sizes = out_sizes = None
    if op == "all_gather":
        out_sizes = _sizes(kw["outputs"])
    elif op == "reduce_scatter":
        in_sizes = _sizes(kw["inputs"])
    elif op == "all_to_all":
        in_sizes, out_sizes = _sizes(kw["inputs"]), _sizes(kw["outputs"])
    elif op == "gather":
        out_sizes = _sizes(kw.get("outputs"))
    elif op == "scatter":
        in_sizes = _sizes(kw.get("inputs"))
    nbytes = _nbytes(array)
    if op in ("all_to_all", "reduce_scatter"):
        nbytes = _nbytes(kw.get("inputs"))
    return CollectiveCall(
        op=op,
        group=group,
        shape=shape,
        dtype=dtype,
        root=root,
        reduce_op=reduce_op,
        peer=peer,
        tag=kw.get("tag"),
        in_sizes=in_sizes,
        out_sizes=out_sizes,
        nbytes=nbytes,
    )


def when_done(work: Any, callback) -> None:
    """Call ``callback(error_or_None)`` when ``work`` finishes: now for a finished Work, from
    the finishing thread for a :class:`~pluribus.work.FutureWork`."""
    if isinstance(work, FutureWork):
        work.add_done_callback(lambda w: callback(w.exception()))
    else:
        callback(None)


def global_rank() -> int | None:
    """This process's global rank as the launcher set it (before any group exists)."""
    value = os.environ.get("RANK")
    return int(value) if value is not None and value.isdigit() else None


Around = Generator[None, Any, Any]


class CollectiveWrapper:
    """A plugin wrapping every collective hook with ``self.around(call)``.

    ``around`` is a generator in pluggy's wrapper style: code before its ``yield`` runs before
    the collective is issued, the ``yield`` returns the hook's :class:`Work` (or raises its
    error), and ``around`` returns the Work.
    """

    def around(self, call: CollectiveCall) -> Around:
        return (yield)

    def _wrap(self, op: str, group: Any, **kw: Any) -> Around:
        return (yield from self.around(describe_call(op, group, **kw)))

    @hookimpl(wrapper=True)
    def pluribus_all_reduce(self, group, array, op, async_op):
        return (yield from self._wrap("all_reduce", group, array=array, op=op))

    @hookimpl(wrapper=True)
    def pluribus_broadcast(self, group, array, src, async_op):
        return (yield from self._wrap("broadcast", group, array=array, src=src))

    @hookimpl(wrapper=True)
    def pluribus_reduce(self, group, array, dst, op, async_op):
        return (yield from self._wrap("reduce", group, array=array, dst=dst, op=op))

    @hookimpl(wrapper=True)
    def pluribus_all_gather(self, group, outputs, array, async_op):
        return (yield from self._wrap("all_gather", group, outputs=outputs, array=array))

    @hookimpl(wrapper=True)
    def pluribus_reduce_scatter(self, group, output, inputs, op, async_op):
        return (
            yield from self._wrap("reduce_scatter", group, output=output, inputs=inputs, op=op)
        )

    @hookimpl(wrapper=True)
    def pluribus_all_to_all(self, group, outputs, inputs, async_op):
        return (yield from self._wrap("all_to_all", group, outputs=outputs, inputs=inputs))

    @hookimpl(wrapper=True)
    def pluribus_gather(self, group, array, outputs, dst, async_op):
        return (yield from self._wrap("gather", group, array=array, outputs=outputs, dst=dst))

    @hookimpl(wrapper=True)
    def pluribus_scatter(self, group, array, inputs, src, async_op):
        return (yield from self._wrap("scatter", group, array=array, inputs=inputs, src=src))

    @hookimpl(wrapper=True)
    def pluribus_barrier(self, group, async_op):
        return (yield from self._wrap("barrier", group))

    @hookimpl(wrapper=True)
    def pluribus_send(self, group, array, dst, tag, async_op):
        return (yield from self._wrap("send", group, array=array, dst=dst, tag=tag))

    @hookimpl(wrapper=True)
    def pluribus_recv(self, group, array, src, tag, async_op):
        return (yield from self._wrap("recv", group, array=array, src=src, tag=tag))


HOOK_NAMES = tuple(name for name in dir(CollectiveWrapper) if name.startswith("pluribus_"))


def export_hooks(plugin: CollectiveWrapper, namespace: dict[str, Any]) -> None:
    """Put ``plugin``'s bound hook methods into a module's namespace, so that the module can be
    registered as the plugin (the core registers built-in plugins by module)."""
    for name in HOOK_NAMES:
        namespace[name] = getattr(plugin, name)
