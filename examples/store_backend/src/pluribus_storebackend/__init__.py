"""A complete third-party backend with only send and recv: messages travel through the store.

It is slow (every message is a round trip to the store's server) but it is correct and it spans
processes and hosts, which makes it a good template: replace the two methods with a real
transport and the core gives you every collective.
"""

from __future__ import annotations

import collections

import numpy as np
import pluribus
from pluribus.arrays import byte_view


class StoreBackend(pluribus.Backend):
    name = "storebackend"

    def __init__(self, ctx: pluribus.BackendContext):
        super().__init__(ctx.rank, ctx.size, ctx.timeout)
        self.store = ctx.store
        self.sent = collections.Counter()  # messages sent per (dst, tag): keeps them in order
        self.received = collections.Counter()

    def send(self, array, dst, tag=0):
        seq = self.sent[(dst, tag)]
        self.sent[(dst, tag)] += 1
        self.store.set(f"msg/{self.rank}/{dst}/{tag}/{seq}", byte_view(array).tobytes())

    def recv(self, array, src, tag=0):
        seq = self.received[(src, tag)]
        self.received[(src, tag)] += 1
        key = f"msg/{src}/{self.rank}/{tag}/{seq}"
        payload = self.store.get(key, self.timeout)
        self.store.delete(key)
        target = byte_view(array)
        if len(payload) != target.size:
            raise ValueError(
                f"rank {self.rank}: rank {src} sent {len(payload)} bytes, expected {target.size}"
            )
        target[...] = np.frombuffer(payload, dtype=np.uint8)


@pluribus.hookimpl
def pluribus_backends():
    yield pluribus.BackendSpec(
        name="storebackend",
        create=StoreBackend,
        probe=lambda: pluribus.Availability(True, version="0.1.0"),
        description="example: messages through the rendezvous store",
    )
