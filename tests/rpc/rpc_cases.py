"""What the RPC tests' workers expose, and helpers that run workers as threads or processes.

Functions here are registered on import, so every worker (thread or spawned process) that
imports this module serves the same names.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
from pluribus import rpc
from pluribus.store import HashStore


@rpc.expose
def add(a, b):
    return a + b


@rpc.expose
def echo(*args, **kwargs):
    return args, kwargs


@rpc.expose
def fail(message):
    raise KeyError(message)


@rpc.expose
def sleep(seconds):
    time.sleep(seconds)
    return seconds


@rpc.expose
def echo_after(seconds, value):
    time.sleep(seconds)
    return value


@rpc.expose
def whoami():
    return rpc.get_worker_info().name


@rpc.expose
def relay(path, value):
    """Pass ``value`` along the workers named in ``path`` (nested calls), appending names."""
    me = rpc.get_worker_info().name
    if not path:
        return [me, value]
    return [me, *rpc.rpc_sync(path[0], relay, args=(path[1:], value))]


@rpc.expose
def ping_pong(depth, other):
    """Calls back and forth between two workers ``depth`` times (nested, re-entrant)."""
    if depth == 0:
        return 0
    me = rpc.get_worker_info().name
    return 1 + rpc.rpc_sync(other, ping_pong, args=(depth - 1, me))


@rpc.expose
def make_unsendable():
    return {1, 2, 3}


@rpc.expose
def pid():
    return os.getpid()


@rpc.expose
def scale(array, factor):
    return array * factor


@rpc.expose
def to_here_of(rref):
    return rref.to_here()


@rpc.expose
def keep(rref):
    """Keep an RRef handle on this worker (a second holder) until ``drop_kept``."""
    _kept.append(rref)
    return len(_kept)


@rpc.expose
def drop_kept():
    while _kept:
        _kept.pop().release()
    return True


@rpc.expose
def owned_count(rref_id):
    from pluribus.rpc.api import current_agent

    return current_agent().table.count(rref_id)


@rpc.expose
def owned_total():
    from pluribus.rpc.api import current_agent

    return len(current_agent().table)


@rpc.expose
def pass_on(rref, to):
    """Hand ``rref`` to worker ``to``, which keeps it."""
    return rpc.rpc_sync(to, keep, args=(rref,))


_kept: list = []


@rpc.expose
class Counter:
    def __init__(self, start=0):
        self.value = start

    def add(self, amount):
        self.value += amount
        return self.value

    def get(self):
        return self.value

    def boom(self):
        raise ValueError("boom")


def run_threads(
    world: int, main, *args, timeout: float = 60.0, rpc_timeout: float = 20.0, **init_options
):
    """Run ``main(rank, *args)`` on ``world`` threads, each an RPC worker ``w<rank>``; return
    the results by rank, raising the first error."""
    store = HashStore()
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            rpc.init_rpc(
                f"w{rank}",
                rank=rank,
                world_size=world,
                store=store,
                timeout=rpc_timeout,
                **init_options,
            )
            try:
                results[rank] = main(rank, *args)
            finally:
                rpc.shutdown(timeout=rpc_timeout)
        except BaseException as exc:  # reported below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError("an RPC worker thread did not finish")
    if errors:
        rank = min(errors)
        raise errors[rank]
    return [results[r] for r in range(world)]


@rpc.expose
def in_segment(array) -> bool:
    """Whether ``array`` views a shared-memory segment (not a buffer read from a socket)."""
    item = array
    while item is not None:
        if isinstance(item, mmap.mmap):
            return True
        item = item.obj if isinstance(item, memoryview) else getattr(item, "base", None)
    return False


@rpc.expose
def inspect_large(array):
    """How a large argument arrived, and a large result computed from it."""
    return in_segment(array), bool(array.flags.writeable), array * 2


@rpc.expose
def add_one_in_place(array):
    array += 1
    return array


_held: list = []


@rpc.expose
def hold(array):
    _held.append(array)
    return float(array[0])


@rpc.expose
def held_values():
    return [a.copy() for a in _held]


@rpc.expose
def drop_held():
    _held.clear()


@rpc.expose
def array_example():
    return np.arange(12, dtype=np.float32).reshape(3, 4)
