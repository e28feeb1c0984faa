"""The pluribus plugin module (entry point ``nccl``): the backend spec and the collective hooks.

The hooks take over every collective whose array lives on the GPU of a group whose cuda
backend is an :class:`NcclBackend`, and pass (return None) otherwise, so numpy arrays of a
``"cpu:gloo,cuda:nccl"`` group still go through gloo. They enqueue on the communication stream
from the calling thread, without the core's work queue: CUDA streams already keep the order,
and the returned Work is the CUDA event itself. ``pluribus_bind_collective`` gives a group the
same enqueue-and-wait for its synchronous calls.

Importing this module imports no cupy; that happens in ``probe`` and ``create``.
"""

from __future__ import annotations

from typing import Any

from pluribus import BackendContext, BackendSpec, hookimpl
from pluribus.arrays import device_of

from .backend import NcclBackend, NcclWork, create_backend
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


def nccl_backend_for(group: Any, array: Any) -> NcclBackend | None:
    """The group's NCCL backend when ``array`` is a GPU array it carries, else None."""
    if array is None or device_of(array) != "cuda":
        return None
    backend = getattr(group, "backends", {}).get("cuda")
    return backend if isinstance(backend, NcclBackend) else None


def _finish(backend: NcclBackend, work: NcclWork, async_op: bool) -> NcclWork:
    if not async_op:
        backend.complete(work)
    return work


@hookimpl
def pluribus_bind_collective(group, collective, device):
    """A synchronous call on an NCCL group's GPU arrays enqueues and waits, as the hooks below
    do for ``async_op=False``, without the hook chain."""
    backend = getattr(group, "backends", {}).get(device)
    if device != "cuda" or not isinstance(backend, NcclBackend):
        return None
    if collective == "barrier":  # only NCCL-only groups bind it on "cuda"
        return lambda: backend.barrier_async().wait()
    start = getattr(backend, f"{collective}_async")

    def bound(*args):
        backend.complete(start(*args))

    return bound


@hookimpl
def pluribus_all_reduce(group, array, op, async_op):
    backend = nccl_backend_for(group, array)
    if backend is None:
        return None
    return _finish(backend, backend.all_reduce_async(array, op), async_op)


@hookimpl
def pluribus_broadcast(group, array, src, async_op):
    backend = nccl_backend_for(group, array)
    if backend is None:
        return None
    return _finish(backend, backend.broadcast_async(array, src), async_op)


@hookimpl
def pluribus_reduce(group, array, dst, op, async_op):
    backend = nccl_backend_for(group, array)
    if backend is None:
        return None
    return _finish(backend, backend.reduce_async(array, dst, op), async_op)


@hookimpl
def pluribus_all_gather(group, outputs, array, async_op):
    backend = nccl_backend_for(group, array)
    if backend is None:
        return None
    return _finish(backend, backend.all_gather_async(outputs, array), async_op)


@hookimpl
def pluribus_reduce_scatter(group, output, inputs, op, async_op):
    backend = nccl_backend_for(group, output)
    if backend is None:
        return None
    return _finish(backend, backend.reduce_scatter_async(output, inputs, op), async_op)


@hookimpl
def pluribus_all_to_all(group, outputs, inputs, async_op):
    backend = nccl_backend_for(group, inputs[0] if inputs else None)
    if backend is None:
        return None
    return _finish(backend, backend.all_to_all_async(outputs, inputs), async_op)


@hookimpl
def pluribus_gather(group, array, outputs, dst, async_op):
    backend = nccl_backend_for(group, array)
    if backend is None:
        return None
    return _finish(backend, backend.gather_async(array, outputs, dst), async_op)


@hookimpl
def pluribus_scatter(group, array, inputs, src, async_op):
    backend = nccl_backend_for(group, array)
    if backend is None:
        return None
    return _finish(backend, backend.scatter_async(array, inputs, src), async_op)


@hookimpl
def pluribus_barrier(group, async_op):
    """A group with a CPU backend keeps the core's barrier (through it); an NCCL-only group
    reduces one element on the GPU and, like any barrier, blocks the host until all arrived."""
    backends = getattr(group, "backends", {})
    backend = backends.get("cuda")
    if "cpu" in backends or not isinstance(backend, NcclBackend):
        return None
    work = backend.barrier_async()
    if not async_op:
        work.wait()
    return work


@hookimpl
def pluribus_send(group, array, dst, tag, async_op):
    backend = nccl_backend_for(group, array)
    if backend is None:
        return None
    return _finish(backend, backend.send_async(array, dst), async_op)


@hookimpl
def pluribus_recv(group, array, src, tag, async_op):
    backend = nccl_backend_for(group, array)
    if backend is None:
        return None
    return _finish(backend, backend.recv_async(array, src), async_op)
