"""The plugin module named by the ``pluribus`` entry point: it offers the ``gloo`` backend.

Importing it is cheap: the transport is imported only when a backend is created.
"""

from __future__ import annotations

import os

from pluribus.hookspecs import hookimpl
from pluribus.types import Availability, BackendContext, BackendSpec

from . import __version__

SHM_ENV = "PLURIBUS_GLOO_SHM"
SHM_BYTES_ENV = "PLURIBUS_GLOO_SHM_BYTES"
DEFAULT_SHM_BYTES = 4 << 20


def probe() -> Availability:
    from .connect import platform_ok

    ok, reason = platform_ok()
    if not ok:
        return Availability(
            False,
            reason,
            "run on Linux or macOS (on Windows, inside WSL2), or use the mpi backend",
            __version__,
        )
    from . import shm

    details = {"shared_memory": shm.supported() and os.environ.get(SHM_ENV, "1") != "0"}
    return Availability(True, version=__version__, details=details)


def _shm_wanted(options: dict) -> bool:
    from . import shm

    setting = options.get("shm", os.environ.get(SHM_ENV))
    if setting is None or setting == "":
        return shm.supported()
    if str(setting).lower() in ("0", "false", "off", "no"):
        return False
    return shm._posixshmem is not None


def create(ctx: BackendContext):
    from pluribus.store import AUTH_TOKEN_ENV

    from .backend import GlooBackend
    from .connect import connect_mesh
    from .engine import Engine

    options = dict(ctx.options or {})
    token = options.get("auth_token") or os.environ.get(AUTH_TOKEN_ENV) or None
    capacity = int(options.get("shm_bytes", os.environ.get(SHM_BYTES_ENV, DEFAULT_SHM_BYTES)))
    capacity = max(64 << 10, capacity - capacity % 4096)
    peers = connect_mesh(
        ctx.rank,
        ctx.size,
        ctx.store,
        ctx.timeout,
        token,
        _shm_wanted(options),
        capacity,
        options,
    )
    engine = Engine(ctx.rank, ctx.size, peers, ctx.store, capacity)
    backend = GlooBackend(
        engine, list(range(ctx.size)), ctx.rank, ctx.timeout, ctx.group_name, owner=True
    )
    try:
        backend.attach_arena(ctx.store, options)
    except BaseException:
        engine.close()
        raise
    return backend


@hookimpl
def pluribus_backends():
    yield BackendSpec(
        name="gloo",
        create=create,
        probe=probe,
        devices=("cpu",),
        priority=50,
        description="TCP mesh with shared memory on one host; numpy arrays (pure Python)",
    )
