"""The core's implementation of every operation hook (``trylast``, so any plugin goes first).

One function, :func:`run`, serves every operation of :data:`~pluribus.operations.OPERATIONS`:
it picks the backend from the operation's key array, copies cupy arrays through host memory
when the backend carries only host memory and the group allows it, and then

* for ``async_op=True``, asks the backend to start the operation natively
  (:meth:`Backend.start`), when nothing is queued before it on the group;
* otherwise runs the backend's blocking method (``Backend.all_reduce`` and so on), or the
  generic algorithm over send/recv when it has none, on the group's ordered work queue.

:func:`direct` is the same synchronous path without pluggy: the public API takes it when the
core's implementation is the only one of the hook (see :meth:`ProcessGroup.direct`).
"""

from __future__ import annotations

import functools
import queue
from collections.abc import Callable
from typing import Any

from .. import algorithms
from ..arrays import device_of
from ..backend import Backend
from ..errors import DistTimeoutError, PeerError, PluribusError
from ..operations import Operation, hook_implementations


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


def backend_of(group, op: Operation, args: tuple) -> Backend:
    """The backend that carries the call: the key array's, or for barrier the cpu one."""
    key = op.key_array(args)
    if key is None:
        return group.backends.get("cpu") or next(iter(group.backends.values()))
    return group.backend_for(key)


def _lane(op: Operation, args: tuple) -> Any:
    """Collectives share one ordered lane; point-to-point gets one per direction and peer."""
    return "collectives" if op.collective else (op.name, args[1])


def blocking(backend: Backend, name: str) -> Callable[..., None]:
    """The backend's blocking method for ``name``, or the generic algorithm over send/recv
    (for ``all_reduce_into``: copy, then the backend's all-reduce in place)."""
    native = getattr(backend, name, None)
    if native is not None:
        return native
    if name == "all_reduce_into":
        return functools.partial(_all_reduce_by_copy, blocking(backend, "all_reduce"))
    return functools.partial(getattr(algorithms, name), backend)


def _all_reduce_by_copy(all_reduce: Callable[..., None], array: Any, output: Any, op) -> None:
    output[...] = array
    all_reduce(output, op)


def run(op: Operation, group, args: tuple, async_op: bool):
    """Run one call of ``op``; returns its Work."""
    backend = backend_of(group, op, args)
    key = op.key_array(args)
    lane = _lane(op, args)
    staging = key is not None and device_of(key) not in backend.devices
    name = op.name
    if async_op and not staging:
        ordered = group.lane(lane)
        if not ordered.pending:
            if name == "all_reduce_into" and not hasattr(backend, name):
                # A backend's start knows only the operations it has methods for: the copy
                # now (nothing is queued before it), then the in-place form.
                array, output, reduce_op = args
                output[...] = array
                name, args = "all_reduce", (output, reduce_op)
            with ordered.exec_lock:  # one call into the backend at a time per lane, starts too
                work = backend.start(name, args)
            if work is not None:
                return work
    method = blocking(backend, name)

    def description() -> str:
        return describe(op, group, args)

    def job():
        try:
            if not staging:
                method(*args)
                return
            host_args = tuple(_to_host(a) for a in args)
            method(*host_args)
            for i in op.written_indices:
                _copy_back(args[i], host_args[i])
        except Exception as exc:
            raise translate(exc, group, backend, description()) from exc

    return group.submit(job, async_op, description, lane)


def direct(group, op: Operation, device: str) -> Callable[..., None] | None:
    """A function running synchronous ``op`` calls for ``device`` arrays as :func:`run` would,
    or None where ``run`` must decide per call (host staging)."""
    backend: Backend | None = group.backends.get(device)
    if backend is None or device not in backend.devices or group.watched or not op.collective:
        return None  # host staging, the core's watch, a lane per peer: decided per call
    method = blocking(backend, op.name)
    lane = group.lane("collectives")
    rank, timeout = group.global_rank, group.timeout
    acquire, release = lane.exec_lock.acquire, lane.exec_lock.release

    def call(*args):  # Lane.submit, inlined: this is the fixed cost users time against raw MPI
        if lane.pending:
            lane.submit(
                lambda: method(*args), False, lambda: describe(op, group, args), rank, timeout
            )
            return
        acquire()
        try:
            method(*args)
        except Exception as exc:
            raise translate(exc, group, backend, describe(op, group, args)) from exc
        finally:
            release()

    return call


def describe(op: Operation, group, args: tuple) -> str:
    """How a call reads in errors: ``all_reduce(shape=(4,), dtype=float32) on group 'world'``."""
    key = op.key_array(args)
    if key is None:
        return f"{op.name} on group {group.name!r}"
    return f"{op.name}(shape={key.shape}, dtype={key.dtype}) on group {group.name!r}"


def translate(exc: Exception, group, backend: Backend, description: str) -> Exception:
    """A backend's error as the core's: the failure a lifeline heard of wins over its symptom;
    pluribus errors and the ValueError / TypeError of bad input pass; a raw timeout becomes
    DistTimeoutError and any other transport error PeerError, naming the rank and the call."""
    if group.failure is not None:
        return group.failure_again()
    if isinstance(exc, (PluribusError, ValueError, TypeError)):
        return exc
    what = f"rank {group.global_rank}: {description} on backend {backend.name!r}"
    if isinstance(exc, (TimeoutError, queue.Empty)):
        return DistTimeoutError(
            f"{what} timed out ({type(exc).__name__}: {exc}); another rank has not started the "
            "same operation, or died"
        )
    return PeerError(
        f"{what} failed in the transport ({type(exc).__name__}: {exc}); a peer may have died or "
        "closed its connection"
    )


globals().update(hook_implementations(run, trylast=True))
