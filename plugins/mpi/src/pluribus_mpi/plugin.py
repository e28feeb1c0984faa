"""The ``mpi`` plugin: the backend spec and the rendezvous under mpiexec.

Importing this module imports neither mpi4py nor MPI: ``probe`` loads the library and
``create`` initialises it. The collectives need no hooks here: the core calls the backend's
blocking methods for synchronous calls and :meth:`MPIBackend.start` (a non-blocking MPI call
wrapped in a Work) for ``async_op=True``.
"""

from __future__ import annotations

import os
from typing import Any

from pluribus import BackendSpec, hookimpl

from .probe import CUDA_AWARE_ENV, probe


def create(ctx: Any) -> Any:
    """The world group's backend (sub-groups come from ``MPIBackend.new_subgroup``)."""
    from .backend import create_world

    return create_world(
        ctx.rank, ctx.size, ctx.timeout, dict(ctx.options), ctx.group_name, ctx.store
    )


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
