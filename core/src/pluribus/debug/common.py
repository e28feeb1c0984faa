"""What the debugging aids share: a description of one call, a base class that turns every
operation hook into one ``around(call)`` generator, and switching a wrapper on and off.

The mismatch detector and the trace wrap every operation hook (``wrapper=True``);
:class:`CollectiveWrapper` makes those wrappers from the table of operations, so a subclass
implements only ``around``. (The flight recorder is called by the core's dispatch instead.) An
aid that is off must cost nothing per call, so
the wrapper object is registered with the plugin manager only while its aid is on: the module
registered as a built-in plugin holds just a ``pluribus_group_created`` hook that reads the
environment and calls :func:`set_registered`.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Generator
from typing import Any

from ..operations import OPERATIONS, Operation, hook_implementations

#: Operations every rank of a group must call together (p2p ones are not checked across ranks).
COLLECTIVE_OPS = frozenset(op.name for op in OPERATIONS.values() if op.collective)


def _sizes(items: list[Any] | None) -> list[int] | None:
    return None if items is None else [int(getattr(x, "size", 0)) for x in items]


def _total_bytes(items: list[Any]) -> int:
    return sum(int(getattr(x, "nbytes", 0)) for x in items)


class CollectiveCall:
    """One call of a collective hook, described by plain values (no array is kept alive).

    Made for every call while an aid is on, so it only reads attributes; the byte count of a
    single array is worked out when asked for.
    """

    __slots__ = (
        "op",
        "group",
        "shape",
        "_dtype",
        "root",
        "reduce_op",
        "peer",
        "tag",
        "in_sizes",
        "out_sizes",
        "_nbytes",
        "async_op",
    )

    def __init__(
        self,
        op: str,
        group: Any,
        array: Any = None,
        *,
        root: int | None = None,
        reduce_op: Any = None,
        peer: int | None = None,
        tag: int | None = None,
        in_sizes: list[int] | None = None,
        out_sizes: list[int] | None = None,
        nbytes: int | None = None,
        async_op: bool = False,
    ):
        self.op = op
        self.group = group
        if array is None:
            self.shape = self._dtype = None
        else:  # the core checked it has a dtype; getattr: a wrapper must not fail on an array-like
            self.shape: tuple[int, ...] | None = getattr(array, "shape", ())
            self._dtype = array.dtype  # shown as a string
        self.root = root
        self.reduce_op = reduce_op
        self.peer = peer
        self.tag = tag
        self.in_sizes = in_sizes
        self.out_sizes = out_sizes
        self._nbytes = nbytes
        self.async_op = async_op

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            itemsize = getattr(self._dtype, "itemsize", 0) if self._dtype is not None else 0
            self._nbytes = self.numel() * itemsize
        return self._nbytes

    @property
    def dtype(self) -> str | None:
        return None if self._dtype is None else str(self._dtype)

    @property
    def reduce_op_name(self) -> str | None:
        return None if self.reduce_op is None else self.reduce_op.value

    @property
    def collective(self) -> bool:
        return self.op in COLLECTIVE_OPS

    def describe(self) -> str:
        """``all_reduce(shape=(4,), dtype=float32, op=sum)``: how a rank's call reads in errors."""
        parts = []
        if self.shape is not None:
            parts.append(f"shape={self.shape}")
        if self._dtype is not None:
            parts.append(f"dtype={self.dtype}")
        if self.reduce_op is not None:
            parts.append(f"op={self.reduce_op_name}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.peer is not None:
            parts.append(f"peer={self.peer}")
        return f"{self.op}({', '.join(parts)})"

    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0


def when_done(work: Any, callback) -> None:
    """Call ``callback(error_or_None)`` when ``work`` finishes: from the finishing thread for a
    Work that takes done callbacks (FutureWork, a plugin's request-backed Work), else now."""
    add = getattr(work, "add_done_callback", None)
    if add is not None and not work.is_completed():
        add(lambda w: callback(w.exception()))
    else:
        callback(None)


def global_rank() -> int | None:
    """This process's global rank as the launcher set it (before any group exists)."""
    value = os.environ.get("RANK")
    return int(value) if value is not None and value.isdigit() else None


Around = Generator[None, Any, Any]


def describe(op: Operation, group: Any, args: tuple, async_op: bool = False) -> CollectiveCall:
    """A call of ``op`` with ``args`` (in the table's order) as a CollectiveCall."""
    values = dict(zip(op.args, args, strict=True))
    rank = values.get("src", values.get("dst"))
    counted = values.get(op.counted) if op.counted else None
    return CollectiveCall(
        op.name,
        group,
        op.key_array(args),
        root=rank if op.collective else None,
        peer=None if op.collective else rank,
        reduce_op=values.get("op"),
        tag=values.get("tag"),
        in_sizes=_sizes(values.get("inputs")),
        out_sizes=_sizes(values.get("outputs")),
        nbytes=None if counted is None else _total_bytes(counted),
        async_op=async_op,
    )


class CollectiveWrapper:
    """A plugin wrapping every operation hook with ``self.around(call)``.

    ``around`` is a generator in pluggy's wrapper style: code before its ``yield`` runs before
    the operation is issued, the ``yield`` returns the hook's :class:`Work` (or raises its
    error), and ``around`` returns the Work. The hook implementations are made per instance
    from :data:`~pluribus.operations.OPERATIONS`, so a subclass's ``__init__`` must call this
    one's.
    """

    def __init__(self) -> None:
        for name, implementation in hook_implementations(self._wrap, wrapper=True).items():
            setattr(self, name, implementation)

    def around(self, call: CollectiveCall) -> Around:
        return (yield)

    def _wrap(self, op: Operation, group: Any, args: tuple, async_op: bool) -> Around:
        return (yield from self.around(describe(op, group, args, async_op)))


#: The debugging wrappers from innermost to outermost: the trace's durations include the
#: detector's exchange. (The flight recorder is no wrapper: the core's dispatch calls it first.)
WRAPPER_ORDER = ("debug-detail-calls", "trace-calls")

_registration_lock = threading.Lock()
_wanted: dict[str, CollectiveWrapper] = {}
_registered: list[str] = []  # what set_registered registered, in order


def set_registered(plugin: CollectiveWrapper, name: str, wanted: bool) -> None:
    """Register ``plugin``'s wrappers with the plugin manager under ``name``, or take them out,
    so that an aid that is off adds nothing to a collective call. The registered wrappers always
    nest in :data:`WRAPPER_ORDER`, whichever aid was switched on first."""
    from ..plugins import get_plugin_manager

    manager = get_plugin_manager()
    with _registration_lock:
        if wanted:
            _wanted[name] = plugin
        else:
            _wanted.pop(name, None)
        order = [n for n in WRAPPER_ORDER if n in _wanted]
        order += sorted(n for n in _wanted if n not in WRAPPER_ORDER)
        if order == _registered and all(manager.get_plugin(n) is _wanted[n] for n in order):
            return
        for n in _registered:
            if manager.has_plugin(n):
                manager.unregister(name=n)
        _registered.clear()
        for n in order:  # pluggy runs the wrapper registered last outermost
            manager.register(_wanted[n], name=n)
            _registered.append(n)
