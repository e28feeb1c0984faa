"""A test-only backend that carries messages through the job's store ("storewire").

It lets the launcher tests run real collectives between processes (and between network
namespaces) without the gloo plugin: ``send`` sets a key per message, ``recv`` waits for it
and deletes it. Every collective then runs the core's generic algorithms over it. Slow (a store
round trip per message), which does not matter for a handful of small arrays.

A rank script uses it with::

    import launcher_store_backend
    launcher_store_backend.register()
    pluribus.init_process_group("storewire")
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np
import pluribus
from pluribus import Availability, Backend, BackendSpec, hookimpl
from pluribus.arrays import byte_view
from pluribus.errors import DistTimeoutError


class StoreWireBackend(Backend):
    name = "storewire"

    def __init__(self, store, rank: int, size: int, timeout: float):
        super().__init__(rank, size, timeout)
        self.store = store
        self._sent: dict[tuple[int, int], int] = collections.defaultdict(int)
        self._received: dict[tuple[int, int], int] = collections.defaultdict(int)
        self._lock = threading.Lock()

    def _next(self, counters, peer: int, tag: int) -> int:
        with self._lock:
            counters[(peer, tag)] += 1
            return counters[(peer, tag)]

    def send(self, array: Any, dst: int, tag: int = 0) -> None:
        n = self._next(self._sent, dst, tag)
        self.store.set(f"m/{self.rank}/{dst}/{tag}/{n}", byte_view(array).tobytes())

    def recv(self, array: Any, src: int, tag: int = 0) -> None:
        n = self._next(self._received, src, tag)
        key = f"m/{src}/{self.rank}/{tag}/{n}"
        # Poll rather than block: a blocking get would hold the store connection that this
        # rank's concurrent send needs.
        deadline = time.monotonic() + self.timeout
        delay = 0.0005
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise DistTimeoutError(f"rank {self.rank}: nothing from rank {src} (tag {tag})")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        payload = np.frombuffer(self.store.get(key), dtype=np.uint8)
        self.store.delete(key)
        target = byte_view(array)
        if payload.size != target.size:
            raise ValueError(
                f"rank {self.rank}: rank {src} sent {payload.size} bytes, expected {target.size}"
            )
        target[...] = payload


class _Plugin:
    @hookimpl
    def pluribus_backends(self):
        yield BackendSpec(
            name="storewire",
            create=lambda ctx: StoreWireBackend(ctx.store, ctx.rank, ctx.size, ctx.timeout),
            probe=lambda: Availability(True, version="test"),
            description="test-only: messages through the store",
        )


def register() -> None:
    manager = pluribus.get_plugin_manager()
    if manager.get_plugin("storewire") is None:
        manager.register(_Plugin(), name="storewire")
        pluribus.plugins.registry().specs = None  # let the new backend be seen
