"""The ``threads`` backend: N ranks as threads of one process.

It implements only ``send`` and ``recv``, so every collective on it runs the core's generic
algorithms: the reference for backend authors and the fast path for tests. Ranks find each other
through the store: rank 0 makes a fabric (mailboxes keyed by source, destination and tag), puts
its id in the store, and the others look it up in this process.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any

import numpy as np

from ..arrays import byte_view
from ..backend import Backend
from ..errors import DistTimeoutError, PeerError
from ..hookspecs import hookimpl
from ..types import Availability, BackendContext, BackendSpec

# Fabrics waiting for their ranks to join; the last rank to join removes its fabric from here.
_fabrics: dict[int, _Fabric] = {}
_fabrics_lock = threading.Lock()
_fabric_ids = itertools.count(1)


class _Fabric:
    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.boxes: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(
            collections.deque
        )
        self.failed: dict[int, str] = {}
        self.joined = 0


class ThreadsBackend(Backend):
    name = "threads"
    detects_failures = True  # one process: a failed rank marks the fabric (abort)
    send_blocks = False  # send only enqueues a copy

    def __init__(self, fabric: _Fabric, rank: int, size: int, timeout: float):
        super().__init__(rank, size, timeout)
        self.fabric = fabric

    def send(self, array: Any, dst: int, tag: int = 0) -> None:
        payload = np.array(byte_view(array), copy=True)
        f = self.fabric
        with f.cond:
            f.boxes[(self.rank, dst, tag)].append(payload)
            f.cond.notify_all()

    def recv(self, array: Any, src: int, tag: int = 0) -> None:
        f = self.fabric
        start = time.monotonic()
        with f.cond:
            # the mailbox is looked up (made, if new) under the lock, as send does: made outside
            # it, a send between the factory and the store lands in a box nobody reads
            box = f.boxes[(src, self.rank, tag)]
            ok = f.cond.wait_for(lambda: box or f.failed, self.timeout)
            if not ok:
                raise DistTimeoutError(
                    f"rank {self.rank}: no message from rank {src} (tag {tag}) after "
                    f"{time.monotonic() - start:.1f}s"
                )
            if not box:  # the first rank that failed is the root cause, whoever this waits on
                first, reason = next(iter(f.failed.items()))
                raise PeerError(f"rank {self.rank}: rank {first} failed: {reason}", first)
            payload = box.popleft()
        target = byte_view(array)
        if payload.size != target.size:
            raise ValueError(
                f"rank {self.rank}: rank {src} sent {payload.size} bytes but this rank expected "
                f"{target.size}; the ranks passed arrays of different sizes"
            )
        target[...] = payload

    def abort(self, reason: str) -> None:
        with self.fabric.cond:
            self.fabric.failed[self.rank] = reason
            self.fabric.cond.notify_all()


def create(ctx: BackendContext) -> ThreadsBackend:
    key = "threads/fabric"
    if ctx.rank == 0:
        fid = next(_fabric_ids)
        with _fabrics_lock:
            _fabrics[fid] = _Fabric(ctx.size)
        ctx.store.set(key, str(fid))
    else:
        fid = int(ctx.store.get(key, ctx.timeout))
    with _fabrics_lock:
        fabric = _fabrics.get(fid)
        if fabric is None:
            raise PeerError(
                f"rank {ctx.rank}: the threads backend's ranks must be threads of one process; "
                "use gloo for ranks in separate processes"
            )
        fabric.joined += 1
        if fabric.joined == fabric.size:
            del _fabrics[fid]
    return ThreadsBackend(fabric, ctx.rank, ctx.size, ctx.timeout)


@hookimpl
def pluribus_backends():
    yield BackendSpec(
        name="threads",
        create=create,
        probe=lambda: Availability(True, version="builtin"),
        priority=-100,
        description="ranks as threads of one process (tests, backend authors)",
    )
