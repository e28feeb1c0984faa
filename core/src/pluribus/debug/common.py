"""What the debugging plugins share: a description of one collective call, a base class that
turns every collective hook into one ``around(call)`` generator, and switching a wrapper on and
off.

Each debugging aid wraps every collective hook (``wrapper=True``); writing eleven near-identical
wrappers three times would hide what each aid does, so :class:`CollectiveWrapper` writes them
once and a subclass implements only ``around``. An aid that is off must cost nothing per call, so
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

from ..hookspecs import hookimpl
from ..work import CompletedWork

#: Operations every rank of a group must call together (p2p ones are not checked across ranks).
COLLECTIVE_OPS = frozenset(
    (
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
)


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


def _all_reduce(group, array, op, async_op=False):
    return CollectiveCall("all_reduce", group, array, reduce_op=op, async_op=async_op)


def _broadcast(group, array, src, async_op=False):
    return CollectiveCall("broadcast", group, array, root=src, async_op=async_op)


def _reduce(group, array, dst, op, async_op=False):
    return CollectiveCall("reduce", group, array, root=dst, reduce_op=op, async_op=async_op)


def _all_gather(group, outputs, array, async_op=False):
    return CollectiveCall("all_gather", group, array, out_sizes=_sizes(outputs), async_op=async_op)


def _reduce_scatter(group, output, inputs, op, async_op=False):
    return CollectiveCall(
        "reduce_scatter",
        group,
        output,
        reduce_op=op,
        in_sizes=_sizes(inputs),
        nbytes=_total_bytes(inputs),
        async_op=async_op,
    )


def _all_to_all(group, outputs, inputs, async_op=False):
    return CollectiveCall(
        "all_to_all",
        group,
        inputs[0] if inputs else None,
        in_sizes=_sizes(inputs),
        out_sizes=_sizes(outputs),
        nbytes=_total_bytes(inputs),
        async_op=async_op,
    )


def _gather(group, array, outputs, dst, async_op=False):
    return CollectiveCall(
        "gather", group, array, root=dst, out_sizes=_sizes(outputs), async_op=async_op
    )


def _scatter(group, array, inputs, src, async_op=False):
    return CollectiveCall(
        "scatter", group, array, root=src, in_sizes=_sizes(inputs), async_op=async_op
    )


def _barrier(group, async_op=False):
    return CollectiveCall("barrier", group, async_op=async_op)


def _send(group, array, dst, tag, async_op=False):
    return CollectiveCall("send", group, array, peer=dst, tag=tag, async_op=async_op)


def _recv(group, array, src, tag, async_op=False):
    return CollectiveCall("recv", group, array, peer=src, tag=tag, async_op=async_op)


#: How each operation's hook arguments (without ``group`` first) read as a CollectiveCall.
DESCRIBE = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "reduce": _reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "gather": _gather,
    "scatter": _scatter,
    "barrier": _barrier,
    "send": _send,
    "recv": _recv,
}

_DONE = CompletedWork()


class CollectiveWrapper:
    """A plugin wrapping every collective hook with ``self.around(call)``.

    ``around`` is a generator in pluggy's wrapper style: code before its ``yield`` runs before
    the collective is issued, the ``yield`` returns the hook's :class:`Work` (or raises its
    error), and ``around`` returns the Work. Functions a group binds for its synchronous calls
    are wrapped with the same ``around``, so an aid sees every call either way.
    """

    def around(self, call: CollectiveCall) -> Around:
        return (yield)

    @hookimpl(wrapper=True)
    def pluribus_bind_collective(self, group, collective, device):
        bound = yield
        if bound is None:
            return None
        describe = DESCRIBE[collective]

        def around_bound(*args):
            steps = self.around(describe(group, *args))
            next(steps)  # the part before the collective
            try:
                bound(*args)
            except BaseException as exc:
                try:
                    steps.throw(exc)
                except StopIteration:
                    pass
                raise
            try:
                steps.send(_DONE)
            except StopIteration:
                return
            raise RuntimeError(f"{type(self).__name__}.around yielded more than once")

        return around_bound

    @hookimpl(wrapper=True)
    def pluribus_all_reduce(self, group, array, op, async_op):
        return (yield from self.around(_all_reduce(group, array, op, async_op)))

    @hookimpl(wrapper=True)
    def pluribus_broadcast(self, group, array, src, async_op):
        return (yield from self.around(_broadcast(group, array, src, async_op)))

    @hookimpl(wrapper=True)
    def pluribus_reduce(self, group, array, dst, op, async_op):
        return (yield from self.around(_reduce(group, array, dst, op, async_op)))

    @hookimpl(wrapper=True)
    def pluribus_all_gather(self, group, outputs, array, async_op):
        return (yield from self.around(_all_gather(group, outputs, array, async_op)))

    @hookimpl(wrapper=True)
    def pluribus_reduce_scatter(self, group, output, inputs, op, async_op):
        return (yield from self.around(_reduce_scatter(group, output, inputs, op, async_op)))

    @hookimpl(wrapper=True)
    def pluribus_all_to_all(self, group, outputs, inputs, async_op):
        return (yield from self.around(_all_to_all(group, outputs, inputs, async_op)))

    @hookimpl(wrapper=True)
    def pluribus_gather(self, group, array, outputs, dst, async_op):
        return (yield from self.around(_gather(group, array, outputs, dst, async_op)))

    @hookimpl(wrapper=True)
    def pluribus_scatter(self, group, array, inputs, src, async_op):
        return (yield from self.around(_scatter(group, array, inputs, src, async_op)))

    @hookimpl(wrapper=True)
    def pluribus_barrier(self, group, async_op):
        return (yield from self.around(_barrier(group, async_op)))

    @hookimpl(wrapper=True)
    def pluribus_send(self, group, array, dst, tag, async_op):
        return (yield from self.around(_send(group, array, dst, tag, async_op)))

    @hookimpl(wrapper=True)
    def pluribus_recv(self, group, array, src, tag, async_op):
        return (yield from self.around(_recv(group, array, src, tag, async_op)))


#: The debugging wrappers from innermost to outermost: the flight recorder sees the calls the
#: mismatch detector stops, and the trace's durations include the detector's exchange.
WRAPPER_ORDER = ("debug-detail-calls", "trace-calls", "flight-recorder-calls")

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
