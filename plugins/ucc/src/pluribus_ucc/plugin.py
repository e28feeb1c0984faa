"""The plugin module named by the ``pluribus`` entry point: offers the ``ucc`` backend."""

from __future__ import annotations

from pluribus import BackendSpec, hookimpl


def _create(ctx):
    from .backend import create

    return create(ctx)


def _probe():
    from .probe import probe

    return probe()


@hookimpl
def pluribus_backends():
    yield BackendSpec(
        name="ucc",
        create=_create,
        probe=_probe,
        devices=("cpu", "cuda"),
        priority=30,
        description="UCX through ucxx: shared memory/CMA on a host, TCP or RDMA between hosts, "
        "CUDA IPC between GPUs",
    )
