"""The pluribus plugin module (entry point ``nccl``): the backend spec.

The collectives need no hooks: the core sends a group's cupy arrays to its cuda backend (numpy
arrays of a ``"cpu:gloo,cuda:nccl"`` group still go through gloo), calling the backend's
blocking methods for synchronous calls and :meth:`NcclBackend.start`, which enqueues on the
communication stream and returns the CUDA event's Work, for ``async_op=True``.

Importing this module imports no cupy; that happens in ``probe`` and ``create``.
"""

from __future__ import annotations

from pluribus import BackendContext, BackendSpec, hookimpl

from .backend import NcclBackend, create_backend
from .runtime import probe


def create(ctx: BackendContext) -> NcclBackend:
    return create_backend(ctx)


@hookimpl
def pluribus_backends():
    yield BackendSpec(
        name="nccl",
        create=create,
        probe=probe,
        devices=("cuda",),
        priority=60,
        description="NVIDIA NCCL through cupy.cuda.nccl: collectives on cupy arrays, one GPU "
        "per rank",
    )
