"""The core's implementation of every collective hook (``trylast``, so any plugin goes first).

Each runs on the group's ordered work queue and calls the backend's native method when it has one
(``Backend.all_reduce`` and so on) and the generic algorithm from :mod:`pluribus.algorithms`
otherwise. A cupy array on a backend that carries only host memory is copied to the host and
back when the group allows host staging.
"""

from __future__ import annotations

import functools
from typing import Any

from .. import algorithms
from ..arrays import device_of
from ..backend import Backend
from ..hookspecs import hookimpl


def _to_host(item: Any) -> Any:
    if isinstance(item, list):
        return [_to_host(x) for x in item]
    if item is not None and device_of(item) == "cuda":
        return item.get()
    return item


def _copy_back(device_item: Any, host_item: Any) -> None:
    if isinstance(device_item, list):
        for d, h in zip(device_item, host_item, strict=True):
            _copy_back(d, h)
    elif device_item is not None and device_item is not host_item:
        device_item.set(host_item)


def _run(
    group,
    name: str,
    key_array: Any,
    async_op: bool,
    args: tuple,
    written: tuple = (0,),
    lane: Any = "collectives",
):
    """Run collective ``name`` with ``args`` (arrays first) on the backend for ``key_array``.

    ``written`` are the indices of the arguments the collective writes: the ones copied back to
    the GPU after host staging.
    """
    backend: Backend = group.backend_for(key_array)
    staging = key_array is not None and device_of(key_array) not in backend.devices

    def job():
        call_args = tuple(_to_host(a) for a in args) if staging else args
        native = getattr(backend, name, None)
        if native is not None:
            native(*call_args)
        else:
            getattr(algorithms, name)(backend, *call_args)
        if staging:
            for i in written:
                _copy_back(args[i], call_args[i])

    def description() -> str:
        shape = getattr(key_array, "shape", "")
        dtype = getattr(key_array, "dtype", "")
        return f"{name}(shape={shape}, dtype={dtype}) on group {group.name!r}"

    return group.submit(job, async_op, description, lane)


@hookimpl(trylast=True)
def pluribus_bind_collective(group, collective, device):
    """Bind the backend's native method (or the generic algorithm) for arrays the backend
    carries itself; host-staged arrays keep the per-call path, which copies them."""
    backend: Backend = group.backends.get(device)
    if backend is None or device not in backend.devices:
        return None
    run = getattr(backend, collective, None)
    if run is None:
        run = functools.partial(getattr(algorithms, collective), backend)
    lane = group.lane()

    def description() -> str:
        return f"{collective} on group {group.name!r}"

    def bound(*args):
        lane.call(run, args, description, group.global_rank, group.timeout)

    return bound


@hookimpl(trylast=True)
def pluribus_all_reduce(group, array, op, async_op):
    return _run(group, "all_reduce", array, async_op, (array, op))


@hookimpl(trylast=True)
def pluribus_broadcast(group, array, src, async_op):
    return _run(group, "broadcast", array, async_op, (array, src))


@hookimpl(trylast=True)
def pluribus_reduce(group, array, dst, op, async_op):
    return _run(group, "reduce", array, async_op, (array, dst, op))


@hookimpl(trylast=True)
def pluribus_all_gather(group, outputs, array, async_op):
    return _run(group, "all_gather", array, async_op, (outputs, array))


@hookimpl(trylast=True)
def pluribus_reduce_scatter(group, output, inputs, op, async_op):
    return _run(group, "reduce_scatter", output, async_op, (output, inputs, op))


@hookimpl(trylast=True)
def pluribus_all_to_all(group, outputs, inputs, async_op):
    key = inputs[0] if inputs else None
    return _run(group, "all_to_all", key, async_op, (outputs, inputs))


@hookimpl(trylast=True)
def pluribus_gather(group, array, outputs, dst, async_op):
    return _run(group, "gather", array, async_op, (array, outputs, dst), written=(1,))


@hookimpl(trylast=True)
def pluribus_scatter(group, array, inputs, src, async_op):
    return _run(group, "scatter", array, async_op, (array, inputs, src))


@hookimpl(trylast=True)
def pluribus_barrier(group, async_op):
    backend = group.backends.get("cpu") or next(iter(group.backends.values()))

    def job():
        native = getattr(backend, "barrier", None)
        native() if native is not None else algorithms.barrier(backend)

    return group.submit(job, async_op, f"barrier on {group.name}")


@hookimpl(trylast=True)
def pluribus_send(group, array, dst, tag, async_op):
    return _run(group, "send", array, async_op, (array, dst, tag), (), ("send", dst))


@hookimpl(trylast=True)
def pluribus_recv(group, array, src, tag, async_op):
    return _run(group, "recv", array, async_op, (array, src, tag), (0,), ("recv", src))
