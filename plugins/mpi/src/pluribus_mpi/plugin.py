"""The ``mpi`` plugin: the backend spec, and the collective hooks for groups on MPI.

Importing this module imports neither mpi4py nor MPI: ``probe`` loads the library and
``create`` initialises it. The collective hooks below take every operation on a group whose
backend is an :class:`~pluribus_mpi.backend.MPIBackend` and start it as a non-blocking MPI
operation on the calling thread, so that ``async_op=True`` returns a Work around the MPI request
(instead of a job on the core's worker thread); for any other group they return None. A group's
synchronous calls skip the hooks: ``pluribus_bind_collective`` gives it the backend's blocking
functions once.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from pluribus import BackendSpec, hookimpl
from pluribus.arrays import device_of
from pluribus.work import CompletedWork

from .probe import CUDA_AWARE_ENV, probe

_BACKEND_MODULE = "pluribus_mpi.backend"


def create(ctx: Any) -> Any:
    """The world group's backend (sub-groups come from ``MPIBackend.new_subgroup``)."""
    from .backend import create_world

    return create_world(ctx.rank, ctx.size, ctx.timeout, dict(ctx.options), ctx.group_name)


def _spec_devices() -> tuple[str, ...]:
    # Decided without loading MPI; the backend itself asks the library (MPIX_Query_cuda_support)
    # and takes cupy arrays on a group created with backend="cpu:mpi,cuda:mpi".
    forced = os.environ.get(CUDA_AWARE_ENV, "").strip().lower()
    return ("cpu", "cuda") if forced in ("1", "true", "yes") else ("cpu",)


@hookimpl
def pluribus_backends():
    yield BackendSpec(
        name="mpi",
        create=create,
        probe=probe,
        devices=_spec_devices(),
        priority=40,
        description="MPI through mpi4py: start jobs with mpiexec (clusters, supercomputers)",
    )


@hookimpl
def pluribus_rendezvous(init_method, rank, world_size, timeout, backends):
    """Under mpiexec, rank and world size come from MPI and rank 0 serves the store."""
    from .env import mpi_rendezvous

    return mpi_rendezvous(init_method, rank, world_size, timeout, backends)


# -- collectives ----------------------------------------------------------------------------------

_COMPLETED = CompletedWork()


def _mpi_backend(group: Any, array: Any) -> Any:
    module = sys.modules.get(_BACKEND_MODULE)
    if module is None:  # no MPI backend was ever created in this process
        return None
    backend = group.backend_for(array) if array is not None else _any_backend(group)
    return backend if isinstance(backend, module.MPIBackend) else None


def _any_backend(group: Any) -> Any:
    return group.backends.get("cpu") or next(iter(group.backends.values()))


def _start(group, name: str, key: Any, args: tuple, async_op: bool, written: tuple = (0,)):
    backend = _mpi_backend(group, key)
    if backend is None:
        return None
    staging = (
        key is not None
        and group.gpu_staging
        and not backend.cuda_aware
        and device_of(key) == "cuda"
    )
    if async_op:
        return backend.start(name, args, written, key, staging)
    backend.execute(name, args, written, key, staging)
    return _COMPLETED


@hookimpl
def pluribus_bind_collective(group, collective, device):
    """An MPI group's synchronous calls go straight to the backend (the hooks below would take
    every one of them); host-staged cupy arrays keep the per-call path."""
    module = sys.modules.get(_BACKEND_MODULE)
    backend = group.backends.get(device)
    if module is None or not isinstance(backend, module.MPIBackend):
        return None
    return backend.bind(collective, device)


@hookimpl
def pluribus_all_reduce(group, array, op, async_op):
    return _start(group, "all_reduce", array, (array, op), async_op)


@hookimpl
def pluribus_broadcast(group, array, src, async_op):
    return _start(group, "broadcast", array, (array, src), async_op)


@hookimpl
def pluribus_reduce(group, array, dst, op, async_op):
    return _start(group, "reduce", array, (array, dst, op), async_op)


@hookimpl
def pluribus_all_gather(group, outputs, array, async_op):
    return _start(group, "all_gather", array, (outputs, array), async_op)


@hookimpl
def pluribus_reduce_scatter(group, output, inputs, op, async_op):
    return _start(group, "reduce_scatter", output, (output, inputs, op), async_op)


@hookimpl
def pluribus_all_to_all(group, outputs, inputs, async_op):
    key = inputs[0] if inputs else None
    return _start(group, "all_to_all", key, (outputs, inputs), async_op)


@hookimpl
def pluribus_gather(group, array, outputs, dst, async_op):
    return _start(group, "gather", array, (array, outputs, dst), async_op, written=(1,))


@hookimpl
def pluribus_scatter(group, array, inputs, src, async_op):
    return _start(group, "scatter", array, (array, inputs, src), async_op)


@hookimpl
def pluribus_barrier(group, async_op):
    return _start(group, "barrier", None, (), async_op, written=())


@hookimpl
def pluribus_send(group, array, dst, tag, async_op):
    return _start(group, "send", array, (array, dst, tag), async_op, written=())


@hookimpl
def pluribus_recv(group, array, src, tag, async_op):
    return _start(group, "recv", array, (array, src, tag), async_op)
