"""The public calls (torch.distributed.rpc's names) and which agent they act on.

A process has one agent, started by ``init_rpc`` on its main thread. Tests run several workers
as threads of one process: ``init_rpc`` on another thread gives that thread its own agent, and
the agent's handler threads act on it too.
"""

from __future__ import annotations

import os
import secrets as _secrets
import threading
import time
from datetime import timedelta
from typing import Any

from ..distributed import get_default_group, is_initialized, rendezvous
from ..errors import PluribusError
from ..store import AUTH_TOKEN_ENV, PrefixStore, Store
from ..tcp_mesh import listen_address
from . import registry, wire
from .agent import Agent, WorkerInfo
from .futures import Future
from .rref import RRef

DEFAULT_TIMEOUT = 60.0
_NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:")

_process: dict[str, Any] = {}
_thread = threading.local()


def current_agent() -> Agent:
    agent = getattr(_thread, "agent", None) or _process.get("agent")
    if agent is None:
        raise PluribusError(
            "RPC is not running in this process: call pluribus.rpc.init_rpc(name, rank=..., "
            "world_size=...) first (or after shutdown, again)"
        )
    return agent


def init_rpc(
    name: str,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    init_method: str | None = None,
    store: Store | None = None,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    num_worker_threads: int = 16,
    max_threads: int = 256,
    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE,
    secret: str | None = None,
    listen_addr: str | None = None,
    shared_memory: bool = True,
) -> WorkerInfo:
    """Start this worker's RPC agent under ``name`` and wait until every worker has.

    The rendezvous is ``init_process_group``'s (env://, tcp://, file://, pluribus-run, mpiexec),
    or the default process group's store when one exists, or ``store`` with ``rank`` and
    ``world_size``. ``timeout`` is the default of every call (each may pass its own).
    ``num_worker_threads`` handlers run at once (``max_threads`` threads at most, counting
    handlers that wait for nested calls). The secret is ``PLURIBUS_AUTH_TOKEN`` (pluribus-run
    makes one per job); without one, worker 0 makes one and shares it through the store.
    ``shared_memory=False`` keeps large arrays between workers of one host on TCP too.
    """
    who = f"worker {name!r}"
    if not isinstance(name, str) or not name or len(name) > 128:
        raise ValueError(f"init_rpc: the name must be a non-empty string, got {name!r}")
    if not set(name) <= _NAME_CHARACTERS:
        raise ValueError(f"init_rpc: the name {name!r} may use letters, digits and _ - . : only")
    in_thread = threading.current_thread() is not threading.main_thread()
    if getattr(_thread, "agent", None) is not None or (not in_thread and "agent" in _process):
        raise PluribusError(f"{who}: init_rpc was already called here; call shutdown() first")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"{who}: timeout must be positive, got {timeout!r}")
    if num_worker_threads < 1 or max_threads < num_worker_threads:
        raise ValueError(
            f"{who}: need 1 <= num_worker_threads <= max_threads, got {num_worker_threads} "
            f"and {max_threads}"
        )
    deadline = time.monotonic() + seconds
    owns_store = False
    if store is None and init_method is None and is_initialized():
        group = get_default_group()
        store = PrefixStore("pluribus-rpc", group.store)
        rank = group.rank if rank is None else rank
        world_size = group.size if world_size is None else world_size
    elif store is None:
        store, rank, world_size = rendezvous(init_method, rank, world_size, seconds)
        owns_store = True
    if rank is None or world_size is None:
        raise ValueError(f"{who}: init_rpc(store=...) needs rank= and world_size=")
    if not 0 <= rank < world_size:
        raise ValueError(f"{who}: rank {rank} is outside the world of size {world_size}")
    secret = secret or os.environ.get(AUTH_TOKEN_ENV) or _shared_secret(store, rank, seconds)
    agent = Agent(
        name,
        rank,
        world_size,
        store,
        secret,
        seconds,
        num_worker_threads,
        max_threads,
        max_message_bytes,
        listen_addr or listen_address(),
        bind_thread=_bind_thread,
        shared_memory=shared_memory,
    )
    try:
        agent.join(deadline)
    except BaseException:
        agent.shutdown(graceful=False, timeout=1.0)
        if owns_store:
            store.close()
        raise
    if in_thread:
        _thread.agent = agent
    else:
        _process["agent"] = agent
    agent.owns_store = owns_store
    return agent.workers[rank]


def _bind_thread(agent: Agent) -> None:
    _thread.agent = agent


def _shared_secret(store: Store, rank: int, timeout: float) -> str:
    """Without a job secret, rank 0 makes one for the RPC and the others read it from the store
    (as safe as the store itself)."""
    if rank == 0:
        store.set("rpc/secret", _secrets.token_hex(16))
    return store.get("rpc/secret", timeout).decode()


def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Stop this worker's agent. Graceful: finish this worker's calls in flight, wait until
    every worker has called shutdown (so none is still called), let running handlers finish;
    then close. It returns within ``timeout`` (default: init_rpc's), whatever the peers do:
    calls still pending then fail with an error saying so."""
    agent = current_agent()
    seconds = agent.timeout if timeout is None else agent.timeout_of(timeout)
    try:
        agent.shutdown(graceful, seconds)
    finally:
        if getattr(_thread, "agent", None) is agent:
            _thread.agent = None
        if _process.get("agent") is agent:
            _process.clear()
        if getattr(agent, "owns_store", False):
            agent.store.close()


def get_worker_info(name: str | None = None) -> WorkerInfo:
    """The ``WorkerInfo`` of worker ``name`` (this worker's without one)."""
    agent = current_agent()
    return agent.workers[agent.rank] if name is None else agent.worker(name)


def _checked(agent: Agent, fn: Any, args: Any, kwargs: Any, what: str):
    who = f"{agent.who}: {what}"
    key = registry.name_of(fn, who)
    if args is None:
        args = ()
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"{who}({key}): args must be a tuple, got {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"{who}({key}): kwargs must be a dict with string keys")
    return key, tuple(args), kwargs


def rpc_sync(
    to: str | int | WorkerInfo,
    fn: Any,
    args: tuple | None = None,
    kwargs: dict | None = None,
    timeout: float | None = None,
) -> Any:
    """Run the exposed ``fn(*args, **kwargs)`` on worker ``to`` and return its result."""
    agent = current_agent()
    key, args, kwargs = _checked(agent, fn, args, kwargs, "rpc_sync")
    return agent.call_function(to, key, args, kwargs, timeout, f"rpc_sync({key})", wait=True)


def rpc_async(
    to: str | int | WorkerInfo,
    fn: Any,
    args: tuple | None = None,
    kwargs: dict | None = None,
    timeout: float | None = None,
) -> Future:
    """Like ``rpc_sync``, returning a Future at once."""
    agent = current_agent()
    key, args, kwargs = _checked(agent, fn, args, kwargs, "rpc_async")
    return agent.call_function(to, key, args, kwargs, timeout, f"rpc_async({key})", wait=False)


def remote(
    to: str | int | WorkerInfo,
    fn: Any,
    args: tuple | None = None,
    kwargs: dict | None = None,
    timeout: float | None = None,
) -> RRef:
    """Run the exposed ``fn`` on worker ``to`` and keep the result there: an RRef to it."""
    agent = current_agent()
    key, args, kwargs = _checked(agent, fn, args, kwargs, "remote")
    return agent.remote(to, key, args, kwargs, timeout)
