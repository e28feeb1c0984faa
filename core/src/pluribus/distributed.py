"""The public collective API, in torch.distributed's names and conventions.

``src``/``dst`` arguments are global ranks (as in torch.distributed); the hooks receive
group-local ones. Every argument is checked here, on the calling rank, before anything is sent.
"""

from __future__ import annotations

import ipaddress
import os
import pickle as _pickle
import socket
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import numpy as np

from . import codec, plugins
from .arrays import check_array, check_cuda_array, check_op, device_of, flat
from .backend import USER_TAG_LIMIT, check_tag_budget
from .debug import flight_recorder
from .errors import DistTimeoutError, NotInitializedError, PluribusError
from .group import NON_GROUP_MEMBER, ProcessGroup
from .lifeline import Lifeline, WatchedStore
from .operations import OPERATIONS
from .plugins import default_backend, get_plugin_manager, resolve_backend
from .store import AUTH_TOKEN_ENV, DEFAULT_TIMEOUT, FileStore, PrefixStore, Store, TCPStore
from .types import BackendContext, ReduceOp
from .work import Work

_global_world: dict[str, Any] = {}


class _ThreadWorld(threading.local):
    """The default group of a rank that is a thread. The class attribute makes a thread without
    one read None without raising (an AttributeError per collective costs more than the MPI
    call)."""

    world: dict[str, Any] | None = None


_thread_world = _ThreadWorld()
#: The process's default group, and how many threads have a default group of their own: while
#: none has, the public all_reduce's shortcut reads the group from here (a thread-local read
#: costs more than the rest of the lookup).
_process_group: ProcessGroup | None = None
_thread_worlds = 0
_thread_worlds_lock = threading.Lock()


def _world() -> dict[str, Any]:
    """The default group's state: per thread for ranks that are threads, else per process."""
    local = _thread_world.world
    return local if local is not None else _global_world


def is_initialized() -> bool:
    return "group" in _world()


def _hook():
    return get_plugin_manager().hook


def _default_group() -> ProcessGroup:
    world = _thread_world.world  # _world(), inlined: every collective asks
    if world is None:
        world = _global_world
    if "group" not in world:
        raise NotInitializedError(
            "pluribus is not initialised in this process: call pluribus.init_process_group() "
            "before any collective (pluribus-run sets the environment it needs)"
        )
    return world["group"]


def _group(group: ProcessGroup | None) -> ProcessGroup:
    if group is NON_GROUP_MEMBER:
        raise ValueError(
            "this rank is not a member of the group passed (new_group returned "
            "NON_GROUP_MEMBER here); only members may call collectives on it"
        )
    group = _default_group() if group is None else group
    if group.closed:
        raise PluribusError(f"rank {group.global_rank}: group {group.name!r} was destroyed")
    return group


def _seconds(timeout: float | timedelta | None) -> float:
    if timeout is None:
        return float(os.environ.get("PLURIBUS_TIMEOUT", DEFAULT_TIMEOUT))
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _parse_backend(backend: str | None) -> dict[str, str]:
    """``"gloo"`` -> {"cpu": "gloo", ...}; ``"cpu:gloo,cuda:nccl"`` -> per-device names."""
    if backend is None:
        chosen = {"cpu": default_backend("cpu")}
        try:
            chosen["cuda"] = default_backend("cuda")
        except PluribusError:
            pass
        return chosen
    if ":" not in backend:
        spec = resolve_backend(backend)
        return {device: backend for device in spec.devices}
    mapping: dict[str, str] = {}
    for part in backend.split(","):
        device, _, name = part.strip().partition(":")
        if device not in ("cpu", "cuda") or not name:
            raise ValueError(
                f"backend string {backend!r}: expected 'name' or 'cpu:name,cuda:name', got {part!r}"
            )
        mapping[device] = name
    return mapping


def _rendezvous(
    init_method: str | None, rank: int | None, world_size: int | None, timeout: float
) -> tuple[Store, int, int]:
    env = os.environ
    if rank is None or rank < 0:
        rank = int(env["RANK"]) if "RANK" in env else None
    if world_size is None or world_size < 0:
        world_size = int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else None
    if rank is None or world_size is None:
        raise ValueError(
            "init_process_group needs rank and world_size: pass them, set RANK and WORLD_SIZE, "
            "or start the job with pluribus-run (or mpiexec for the mpi backend)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of size {world_size}")
    url = urlparse(init_method or "env://")
    if url.scheme == "env":
        if "MASTER_PORT" not in env:
            raise ValueError(
                "init_method env:// needs MASTER_PORT (and MASTER_ADDR for several hosts); "
                "pluribus-run sets both"
            )
        host = env.get("MASTER_ADDR", "127.0.0.1")
        port = int(env["MASTER_PORT"])
    elif url.scheme == "tcp":
        host, port = url.hostname or "127.0.0.1", url.port or 0
    elif url.scheme == "file":
        return FileStore(url.path, timeout), rank, world_size
    else:
        raise ValueError(f"init_method {init_method!r}: use env://, tcp://host:port or file://path")
    _take_secret(host)
    # The launcher may already serve the store; then rank 0 is a client like the others.
    served = env.get("PLURIBUS_STORE_SERVED") == "1"
    store = TCPStore(host, port, is_master=(rank == 0 and not served), timeout=timeout)
    return store, rank, world_size


def rendezvous(
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | timedelta | None = None,
    backends: dict[str, str] | None = None,
) -> tuple[Store, int, int]:
    """The job's store, this process's rank and the world size, found the way
    ``init_process_group`` finds them (a plugin's launcher first, e.g. mpiexec; then env://,
    tcp:// or file://). For layers with their own transport, such as ``pluribus.rpc``."""
    seconds = _seconds(timeout)
    found = _hook().pluribus_rendezvous(
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=seconds,
        backends=backends or {},
    )
    if found is None:
        found = _rendezvous(init_method, rank, world_size, seconds)
    return found


#: A job's shared secret for env:// and tcp:// jobs started without pluribus-run (which sets
#: PLURIBUS_AUTH_TOKEN itself): the store, the gloo mesh and the lifelines all answer to it.
SECRET_ENV = "PLURIBUS_SECRET"
_warned_no_secret = False


def _take_secret(host: str) -> None:
    """Adopt ``PLURIBUS_SECRET`` as the job's auth token; warn once when a job without one
    rendezvouses on an address other hosts can reach."""
    global _warned_no_secret
    env = os.environ
    if env.get(SECRET_ENV) and not env.get(AUTH_TOKEN_ENV):
        env[AUTH_TOKEN_ENV] = env[SECRET_ENV]
    if env.get(AUTH_TOKEN_ENV) or _warned_no_secret or _is_loopback(host):
        return
    _warned_no_secret = True
    warnings.warn(
        f"this job rendezvouses on {host}, which other hosts can reach, without a shared "
        f"secret: anyone who can connect can read and overwrite the store and pose as a rank. "
        f"Set {SECRET_ENV} to the same random value on every rank (pluribus-run sets one)",
        stacklevel=4,
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | timedelta | None = None,
    store: Store | None = None,
    group_name: str = "world",
    backend_options: dict[str, Any] | None = None,
) -> ProcessGroup:
    """Join the job: rendezvous through a store and create the default group's backends.

    ``backend`` is a name ("gloo", "mpi", ...), ``"cpu:gloo,cuda:nccl"`` for one group that
    carries both, or None for the best available. With ``store`` given, ``rank`` and
    ``world_size`` are required and ``init_method`` is ignored.
    """
    in_thread = threading.current_thread() is not threading.main_thread()
    world = (_thread_world.world or {}) if in_thread else _global_world
    if "group" in world:
        raise PluribusError(
            f"rank {world['group'].global_rank}: init_process_group was already called in this "
            "process; call destroy_process_group() first to start over"
        )
    seconds = _seconds(timeout)
    mapping = _parse_backend(backend)  # unknown backends fail here, before any connection
    for name in set(mapping.values()):
        resolve_backend(name)
    if store is None:
        store, rank, world_size = rendezvous(init_method, rank, world_size, seconds, mapping)
        owns_store = True
    else:
        if rank is None or world_size is None:
            raise ValueError("init_process_group(store=...) needs rank= and world_size=")
        owns_store = False
    # Each default group started on a store that held one before (the launcher's outlives a
    # group) keys it under a prefix of its own, or a backend would read the last group's keys
    # as this one's. Each rank counts its own starts in the store itself: a fresh store
    # starts every rank at 0, whatever the process or thread ran before.
    started = store.add(f"pluribus/default-groups-started/{rank}", 1) - 1
    keys = store if started == 0 else PrefixStore(f"restart-{started}", store)
    group = _create_group(
        group_name, list(range(world_size)), rank, mapping, keys, seconds, backend_options or {}
    )
    world.update(group=group, store=store, owns_store=owns_store, mapping=mapping)
    _set_default(world, group, in_thread)
    return group


def _set_default(world: dict[str, Any], group: ProcessGroup | None, in_thread: bool) -> None:
    """Make ``group`` (None: no group) the default of this thread or of the process."""
    global _process_group, _thread_worlds
    if not in_thread:
        _process_group = group
        return
    with _thread_worlds_lock:
        _thread_worlds += 1 if group is not None else -1
    _thread_world.world = world if group is not None else None


def _create_group(
    name: str,
    ranks: list[int],
    rank: int,
    mapping: dict[str, str],
    store: Store,
    timeout: float,
    options: dict[str, Any],
) -> ProcessGroup:
    backends: dict[str, Any] = {}
    made: dict[str, Any] = {}
    stores: list[WatchedStore] = []
    for device, backend_name in mapping.items():
        if backend_name not in made:
            spec = resolve_backend(backend_name)
            stores.append(WatchedStore(f"{name}/{backend_name}", store))
            ctx = BackendContext(
                rank=rank,
                size=len(ranks),
                store=stores[-1],
                timeout=timeout,
                group_name=name,
                device=device,
                options=options,
            )
            made[backend_name] = spec.create(ctx)
            check_tag_budget(made[backend_name], rank)
        backends[device] = made[backend_name]
    lifeline = None
    if any(not backend.detects_failures for backend in made.values()):
        lifeline = Lifeline(rank, len(ranks), PrefixStore(f"{name}/core", store), timeout)
    group = ProcessGroup(
        name,
        ranks,
        rank,
        backends,
        timeout,
        store,
        lifeline=lifeline,
        stores=_watched(stores, made),
    )
    _hook().pluribus_group_created(group=group)
    return group


def _watched(stores: list[WatchedStore], made: dict[Any, Any]) -> list[WatchedStore]:
    """The stores of the backends that leave failures to the core (made in the same order):
    the ones whose waits a failure ends. A backend that detects failures keeps its store."""
    return [s for s, b in zip(stores, made.values(), strict=True) if not b.detects_failures]


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Close a group's backends; with no argument, the default group and its store."""
    world = _world()
    if group is None:
        if "group" not in world:
            return
        default = world["group"]
        for sub in world.get("subgroups", []):
            _close_group(sub)
        _close_group(default)
        if default.lifeline is not None:
            default.lifeline.close()
        if world.get("owns_store"):
            world["store"].close()
        world.clear()
        _set_default(world, None, world is _thread_world.world)
        return
    if group is NON_GROUP_MEMBER:
        return
    _close_group(group)


def _close_group(group: ProcessGroup) -> None:
    if group.closed:
        return
    _hook().pluribus_group_destroyed(group=group)
    group.close()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank: global for the default group, group-local for another."""
    return _group(group).rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    return _group(group).size


def get_backend(group: ProcessGroup | None = None) -> str:
    return _group(group).backend_name


def get_default_group() -> ProcessGroup:
    return _default_group()


def new_group(
    ranks: list[int] | None = None, timeout: float | timedelta | None = None
) -> ProcessGroup | Any:
    """A group of the given global ranks. Every rank of the world calls it, in the same order
    (as in torch.distributed); ranks outside it get ``NON_GROUP_MEMBER``."""
    parent = _default_group()
    members = sorted(range(parent.size) if ranks is None else ranks)
    if len(set(members)) != len(members) or any(not 0 <= r < parent.size for r in members):
        raise ValueError(
            f"rank {parent.global_rank}: new_group ranks {ranks} must be distinct ranks of the "
            f"world 0..{parent.size - 1}"
        )
    name = parent.next_subgroup_name()
    if parent.global_rank not in members:
        return NON_GROUP_MEMBER
    seconds = parent.timeout if timeout is None else _seconds(timeout)
    _check_members(parent, name, members, seconds)
    local = members.index(parent.global_rank)
    backends: dict[str, Any] = {}
    made: dict[int, Any] = {}
    stores: list[WatchedStore] = []
    for device, backend in parent.backends.items():
        if id(backend) not in made:
            stores.append(WatchedStore(f"{name}/{backend.name}", parent.store))
            ctx = BackendContext(
                rank=local,
                size=len(members),
                store=stores[-1],
                timeout=seconds,
                group_name=name,
                device=device,
            )
            made[id(backend)] = backend.new_subgroup(members, ctx)
            check_tag_budget(made[id(backend)], local)
        backends[device] = made[id(backend)]
    group = ProcessGroup(
        name,
        members,
        local,
        backends,
        seconds,
        parent.store,
        parent.gpu_staging,
        parent.lifeline,
        _watched(stores, made),
    )
    _world().setdefault("subgroups", []).append(group)
    _hook().pluribus_group_created(group=group)
    return group


def _check_members(parent: ProcessGroup, name: str, members: list[int], timeout: float) -> None:
    """Every member made group ``name`` of the same ranks. Ranks that call ``new_group`` in
    different orders pair up different groups under one name, which would fail much later
    as a collective's timeout; here the error says so."""
    me, text = parent.global_rank, ",".join(map(str, members))
    parent.store.set(f"{name}/members/{me}", text)
    # each member compares with the first (the first with the second): one read each, and a
    # member that disagrees with the first learns it
    others = [r for r in members if r != me]
    for r in others[:1]:
        try:
            theirs = parent.store.get(f"{name}/members/{r}", timeout)
        except (DistTimeoutError, TimeoutError):
            raise DistTimeoutError(
                f"rank {me}: rank {r} did not make group {name!r} of ranks {members} within "
                f"{timeout:.0f}s; every rank must call new_group in the same order with the "
                "same ranks"
            ) from None
        theirs = theirs.decode() if isinstance(theirs, bytes) else theirs
        if theirs != text:
            raise ValueError(
                f"rank {me}: new_group made group {name!r} of ranks {members} here and of "
                f"ranks [{theirs.replace(',', ', ')}] on rank {r}; every rank must call "
                "new_group in the same order with the same ranks"
            )


# -- argument checks ------------------------------------------------------------------------------


def _check_same(array: Any, other: Any, what: str, rank: int, writable: bool = True) -> None:
    """``other`` a valid array (written to, unless not ``writable``) of ``array``'s dtype and
    device."""
    check_array(other, what, rank, writable)
    if type(other) is type(array) and other.dtype is array.dtype:
        return  # one type: one device; one dtype object: one dtype
    if np.dtype(other.dtype) != np.dtype(array.dtype):
        raise TypeError(f"rank {rank}: {what} has dtype {other.dtype}, expected {array.dtype}")
    if device_of(other) != device_of(array):
        raise TypeError(
            f"rank {rank}: {what} is on {device_of(other)}, the input on {device_of(array)}"
        )


def _split_rows(array: Any, size: int, rows: int | None = None) -> list[Any]:
    """``size`` contiguous views of equal blocks of rows of ``array``."""
    per = array.shape[0] // size if rows is None else rows
    return [array[i * per : (i + 1) * per] for i in range(size)]


def _split_by(array: Any, sizes: list[int]) -> list[Any]:
    out, start = [], 0
    for n in sizes:
        out.append(array[start : start + n])
        start += n
    return out


def _check_reduction(g: ProcessGroup, array: Any, op: ReduceOp, what: str) -> str:
    """``check_array`` and ``_check_backend_op`` for the array a reduction writes, returning its
    device. What cannot change between calls (dtype, op, backend) is checked once per array
    type, dtype and op on a group; contiguity and writability on every call."""
    try:
        device = g.checked_ops[(type(array), array.dtype, id(op))]
        flags = array.flags
        if flags.c_contiguous and getattr(flags, "writeable", True):  # cupy has none
            return device
    except (AttributeError, KeyError, TypeError):
        pass
    check_array(array, what, g.global_rank)
    return _check_backend_op(g, array, op)


def _carrier(g: ProcessGroup, array: Any):
    """The backend that carries ``array``; an object that only looks like a cupy array is
    refused here, before a backend that carries cupy arrays starts sending it."""
    backend = g.backend_for(array)
    if "cuda" in backend.devices and device_of(array) == "cuda":
        check_cuda_array(array, g.global_rank)
    return backend


def _check_backend_op(g: ProcessGroup, array: Any, op: ReduceOp) -> str:
    """Check ``op`` on ``array``'s dtype and backend; return the array's device."""
    check_op(op, array.dtype, g.global_rank)
    backend = _carrier(g, array)
    reason = backend.unsupported(np.dtype(array.dtype), op)
    if reason:
        raise TypeError(f"rank {g.global_rank}: backend {backend.name!r}: {reason}")
    # Keyed by id(op): ReduceOp members live for good (nothing else is stored), and Enum's
    # hash is slow.
    device = g.checked_ops[(type(array), array.dtype, id(op))] = device_of(array)
    return device


def _issue(g: ProcessGroup, name: str, device: str, async_op: bool, *args: Any):
    """Run a checked operation, ``args`` in :data:`OPERATIONS` order, recorded by the flight
    recorder while it is on. Returns the Work for ``async_op``."""
    if flight_recorder.recorder.enabled:
        return flight_recorder.recorder.record(
            g, OPERATIONS[name], args, async_op, lambda *a: _dispatch(g, name, device, async_op, a)
        )
    return _dispatch(g, name, device, async_op, args)


def _shortcut(
    group: ProcessGroup | None, name: str, array: Any, op: ReduceOp | None = None
) -> tuple[ProcessGroup | None, Callable[..., None] | None]:
    """The group and direct function for a synchronous ``name`` call on ``group`` (None: the
    default) with ``array``'s type and dtype and ``op``, when the group's last checked call of
    ``name`` had the same and no plugin changed since; else ``(None, None)``, and the checked
    path decides (and remembers, :func:`_remember`). A signature fixes what the checks found of
    the array type (its backend), the dtype and the op; the caller checks the rest of the call
    (contiguity, writability, sizes, the other arrays) every time, as the checked path would."""
    g = group if group is not None else _process_group if not _thread_worlds else None
    try:
        kind, dtype, last_op, generation, direct = g.shortcuts[name]
    except (AttributeError, KeyError, TypeError):  # no group here, or no shortcut yet
        return None, None
    if (
        type(array) is kind
        and array.dtype is dtype
        and op is last_op
        and generation == plugins.generation
    ):
        return g, direct
    return None, None


def _remember(
    g: ProcessGroup, name: str, array: Any, op: ReduceOp | None, device: str
) -> Callable[..., None] | None:
    """After the checks of a synchronous call: its direct function (None where a plugin must
    see the calls), which the next calls with the same signature take (:func:`_shortcut`)."""
    direct = g.direct(name, device)
    if direct is not None:
        g.shortcuts[name] = (type(array), array.dtype, op, plugins.generation, direct)
    return direct


def _run_direct(g: ProcessGroup, name: str, direct: Callable[..., None], args: tuple) -> None:
    """A checked synchronous call through its direct function, recorded while the flight
    recorder is on."""
    if flight_recorder.recorder.enabled:
        flight_recorder.recorder.record(g, OPERATIONS[name], args, False, direct)
    else:
        direct(*args)


def _dispatch(g: ProcessGroup, name: str, device: str, async_op: bool, args: tuple):
    """A synchronous call directly when no plugin but the core's implements the hook, anything
    else through the hook."""
    if not async_op:
        direct = g.direct(name, device)
        if direct is not None:
            direct(*args)
            return None
    op = OPERATIONS[name]
    hook = getattr(_hook(), op.hook_name)
    work = hook(group=g, async_op=async_op, **dict(zip(op.args, args, strict=True)))
    return work if async_op else None


# -- collectives ----------------------------------------------------------------------------------


def all_reduce(
    array: Any,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    out: Any = None,
) -> Work | None:
    """Reduce ``array`` across the group, in place on every rank; or, with ``out``, into
    ``out`` (same shape, dtype and device, contiguous, not overlapping ``array``), leaving
    ``array`` unchanged, as MPI's ``Allreduce(sendbuf, recvbuf)``. Each rank may choose either
    form for the same collective."""
    if out is not None:
        return _all_reduce_into(array, out, op, group, async_op)
    if not async_op:
        # The call whose fixed cost users time against raw MPI. A synchronous call with the
        # array type, dtype and op of the group's last checked one (under the same plugins)
        # goes straight to the group's direct function; contiguity and writability are checked
        # every time. Anything else (no group yet, NON_GROUP_MEMBER, a failed or closed group,
        # another combination) takes the checked path below.
        g = group if group is not None else _process_group if not _thread_worlds else None
        try:
            kind, dtype, last_op, generation, direct = g.shortcuts["all_reduce"]
            if (
                type(array) is kind
                and array.dtype is dtype
                and op is last_op
                and generation == plugins.generation
            ):
                flags = array.flags
                if flags.c_contiguous and getattr(flags, "writeable", True):  # cupy has none
                    if flight_recorder.recorder.enabled:
                        flight_recorder.recorder.record(g, _ALL_REDUCE, (array, op), False, direct)
                    else:
                        direct(array, op)
                    return None
        except (AttributeError, KeyError, TypeError):  # no group or no shortcut: checked below
            pass
    g = _group(group)
    device = _check_reduction(g, array, op, "array")
    if not async_op:
        direct = _remember(g, "all_reduce", array, op, device)
        if direct is not None:
            _run_direct(g, "all_reduce", direct, (array, op))
            return None
    return _issue(g, "all_reduce", device, async_op, array, op)


_ALL_REDUCE = OPERATIONS["all_reduce"]


def _all_reduce_into(
    array: Any, out: Any, op: ReduceOp, group: ProcessGroup | None, async_op: bool
) -> Work | None:
    if not async_op:  # the shortcut of the in-place form, with the checks out= adds
        g = group if group is not None else _process_group if not _thread_worlds else None
        try:
            kind, dtype, last_op, generation, direct = g.shortcuts["all_reduce_into"]
            if (
                type(array) is kind
                and type(out) is kind
                and array.dtype is dtype
                and out.dtype is dtype
                and op is last_op
                and generation == plugins.generation
                and out.shape == array.shape
            ):
                flags = out.flags
                if (
                    flags.c_contiguous
                    and getattr(flags, "writeable", True)  # cupy has none
                    and array.flags.c_contiguous
                    and not _overlap(array, out)
                ):
                    args = (array, out, op)
                    if flight_recorder.recorder.enabled:
                        flight_recorder.recorder.record(g, _ALL_REDUCE_INTO, args, False, direct)
                    else:
                        direct(array, out, op)
                    return None
        except (AttributeError, KeyError, TypeError):  # no group or no shortcut: checked below
            pass
    g = _group(group)
    r = g.global_rank
    check_array(array, "array", r, writable=False)
    _check_same(array, out, "out", r)
    device = _check_reduction(g, out, op, "out")
    if out.shape != array.shape:
        raise ValueError(
            f"rank {r}: all_reduce out has shape {out.shape}, the input {array.shape}; "
            "they must be equal"
        )
    if _overlap(array, out):
        raise ValueError(
            f"rank {r}: all_reduce out overlaps the input array; pass a separate output array, "
            "or no out to reduce in place"
        )
    if not async_op:
        _remember(g, "all_reduce_into", out, op, device)
    return _issue(g, "all_reduce_into", device, async_op, array, out, op)


_ALL_REDUCE_INTO = OPERATIONS["all_reduce_into"]


def _overlap(a: Any, b: Any) -> bool:
    """Whether two contiguous arrays share any byte."""
    if isinstance(a, np.ndarray):
        if a is not b and a.flags.owndata and b.flags.owndata:
            return False  # two arrays that each own their memory (may_share_memory: 0.3 us)
        return a.size > 0 and b.size > 0 and np.may_share_memory(a, b)
    start_a, start_b = a.data.ptr, b.data.ptr  # cupy
    return bool(a.size and b.size and start_a < start_b + b.nbytes and start_b < start_a + a.nbytes)


def broadcast(
    array: Any, src: int = 0, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Copy rank ``src``'s ``array`` into ``array`` on every rank."""
    if not async_op:
        g, direct = _shortcut(group, "broadcast", array)
        if direct is not None:
            flags = array.flags
            if flags.c_contiguous and getattr(flags, "writeable", True):  # cupy has none
                _run_direct(g, "broadcast", direct, (array, g.group_rank(src, "src")))
                return None
    g = _group(group)
    check_array(array, "array", g.global_rank)
    _carrier(g, array)
    local = g.group_rank(src, "src")
    device = device_of(array)
    if not async_op:
        _remember(g, "broadcast", array, None, device)
    return _issue(g, "broadcast", device, async_op, array, local)


def reduce(
    array: Any,
    dst: int = 0,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``array`` across the group into rank ``dst``'s ``array``; others keep theirs."""
    g = _group(group)
    device = _check_reduction(g, array, op, "array")
    local = g.group_rank(dst, "dst")
    return _issue(g, "reduce", device, async_op, array, local, op)


def all_gather(
    output: Any, array: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Gather every rank's ``array`` on every rank.

    ``output`` is a list of one array per rank (their sizes may differ between ranks), or one
    array of ``size`` times ``array``'s rows (torch's ``all_gather_into_tensor``).
    """
    if not async_op:
        found = _per_rank_shortcut(group, "all_gather", array, output, None, False)
        if found is not None:
            g, direct, outputs = found
            _run_direct(g, "all_gather", direct, (outputs, array))
            return None
    g = _group(group)
    check_array(array, "array", g.global_rank, writable=False)
    _carrier(g, array)
    outputs = _per_rank(g, "all_gather", array, output, "output", "input", written=True)
    device = device_of(array)
    if not async_op:
        _remember(g, "all_gather", array, None, device)
    return _issue(g, "all_gather", device, async_op, outputs, array)


all_gather_into_tensor = all_gather


def reduce_scatter(
    output: Any,
    input: Any,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce across the group and leave block ``rank`` of the result in ``output``.

    ``input`` is a list of one array per rank (block ``i`` goes to rank ``i``; sizes may differ)
    or one array of ``size`` times ``output``'s elements.
    """
    if not async_op:
        found = _per_rank_shortcut(group, "reduce_scatter", output, input, op, True)
        if found is not None:
            g, direct, inputs = found
            _run_direct(g, "reduce_scatter", direct, (output, inputs, op))
            return None
    g = _group(group)
    device = _check_reduction(g, output, op, "output")
    inputs = _per_rank(g, "reduce_scatter", output, input, "input", "output", written=False)
    if not async_op:
        _remember(g, "reduce_scatter", output, op, device)
    return _issue(g, "reduce_scatter", device, async_op, output, inputs, op)


reduce_scatter_tensor = reduce_scatter


def _per_rank(
    g: ProcessGroup, call: str, piece: Any, whole: Any, what: str, piece_what: str, written: bool
):
    """``whole`` (all-gather's output, ``written``; reduce-scatter's input, only read, so it may
    be read-only) as one array per rank, checked against this rank's ``piece``: a list of one
    array per rank, this rank's of ``piece``'s size, or one array of ``size`` times ``piece``'s
    elements, split."""
    r = g.global_rank
    if isinstance(whole, (list, tuple)):
        blocks = list(whole)
        if len(blocks) != g.size:
            raise ValueError(
                f"rank {r}: {call} {what} list has {len(blocks)} arrays, "
                f"the group has {g.size} ranks"
            )
        for i, block in enumerate(blocks):
            _check_same(piece, block, f"{what}[{i}]", r, written)
        if blocks[g.rank].size != piece.size:
            raise ValueError(
                f"rank {r}: {what}[{g.rank}] has {blocks[g.rank].size} elements, this rank's "
                f"{piece_what} {piece.size}"
            )
        return blocks
    _check_same(piece, whole, what, r, written)
    if whole.size != piece.size * g.size:
        raise ValueError(
            f"rank {r}: {call} {what} has {whole.size} elements, expected "
            f"{g.size} x {piece.size} = {g.size * piece.size}"
        )
    return _split_rows(flat(whole), g.size, piece.size)


def _per_rank_shortcut(
    group: ProcessGroup | None,
    name: str,
    piece: Any,
    whole: Any,
    op: ReduceOp | None,
    piece_written: bool,
) -> tuple[ProcessGroup, Callable[..., None], list[Any]] | None:
    """The group, direct function and per-rank blocks of ``whole`` (all-gather's output,
    reduce-scatter's input: a list of one array per rank or one array) of a synchronous call
    that the shortcut takes (:func:`_shortcut`): ``piece`` contiguous (and writable when
    ``piece_written``), every array of ``whole`` of its type and dtype, contiguous and
    writable, this rank's block of its size; else None."""
    g, direct = _shortcut(group, name, piece, op)
    if direct is None:
        return None
    flags = piece.flags
    if not flags.c_contiguous or (piece_written and not getattr(flags, "writeable", True)):
        return None
    if type(whole) is type(piece):  # one array, the usual form
        if whole.dtype is piece.dtype and whole.size == piece.size * g.size:
            flags = whole.flags
            if flags.c_contiguous and getattr(flags, "writeable", True):
                return g, direct, _split_rows(flat(whole), g.size, piece.size)
        return None
    if isinstance(whole, (list, tuple)):
        if len(whole) == g.size and _all_like(piece, whole) and whole[g.rank].size == piece.size:
            return g, direct, list(whole)
    return None


def all_to_all(
    outputs: list[Any],
    inputs: list[Any],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Send ``inputs[j]`` to rank ``j``; receive rank ``j``'s array into ``outputs[j]``."""
    if not async_op and inputs:
        g, direct = _shortcut(group, "all_to_all", inputs[0])
        if (
            direct is not None
            and len(outputs) == len(inputs) == g.size
            and _all_like(inputs[0], inputs, outputs)
            and outputs[g.rank].size == inputs[g.rank].size
        ):
            _run_direct(g, "all_to_all", direct, (list(outputs), list(inputs)))
            return None
    g = _group(group)
    r = g.global_rank
    if len(outputs) != g.size or len(inputs) != g.size:
        raise ValueError(
            f"rank {r}: all_to_all needs {g.size} inputs and outputs, got "
            f"{len(inputs)} and {len(outputs)}"
        )
    check_array(inputs[0], "inputs[0]", r, writable=False)
    _carrier(g, inputs[0])
    for i in range(g.size):
        _check_same(inputs[0], inputs[i], f"inputs[{i}]", r, writable=False)
        _check_same(inputs[0], outputs[i], f"outputs[{i}]", r)
    if outputs[g.rank].size != inputs[g.rank].size:
        raise ValueError(f"rank {r}: outputs[{g.rank}] and inputs[{g.rank}] differ in size")
    device = device_of(inputs[0])
    if not async_op:
        _remember(g, "all_to_all", inputs[0], None, device)
    return _issue(g, "all_to_all", device, async_op, list(outputs), list(inputs))


def _all_like(first: Any, *lists: list[Any]) -> bool:
    """Whether every array of ``lists`` has ``first``'s type and dtype object and is contiguous
    and writable: what the checks of a call with ``first``'s signature pass without a word."""
    kind, dtype = type(first), first.dtype
    for arrays in lists:
        for array in arrays:
            if type(array) is not kind or array.dtype is not dtype:
                return False
            flags = array.flags
            if not flags.c_contiguous or not getattr(flags, "writeable", True):  # cupy has none
                return False
    return True


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """All-to-all on rows of single arrays; split sizes (in rows) may differ per rank."""
    if not async_op:
        g, direct = _shortcut(group, "all_to_all", input)
        if (
            direct is not None
            and type(output) is type(input)
            and output.dtype is input.dtype
            and input.flags.c_contiguous
            and _all_like(input, (output,))
        ):
            inputs = _rows_per_rank(g, "input", input, input_split_sizes)
            outputs = _rows_per_rank(g, "output", output, output_split_sizes)
            if outputs[g.rank].size == inputs[g.rank].size:
                _run_direct(g, "all_to_all", direct, (outputs, inputs))
                return None
    g = _group(group)
    r = g.global_rank
    check_array(input, "input", r, writable=False)
    _check_same(input, output, "output", r)
    _carrier(g, input)
    inputs = _rows_per_rank(g, "input", input, input_split_sizes)
    outputs = _rows_per_rank(g, "output", output, output_split_sizes)
    if outputs[g.rank].size != inputs[g.rank].size:
        raise ValueError(
            f"rank {r}: this rank's block of output ({outputs[g.rank].size} elements) and of "
            f"input ({inputs[g.rank].size}) differ in size"
        )
    device = device_of(input)
    if not async_op:
        _remember(g, "all_to_all", input, None, device)
    return _issue(g, "all_to_all", device, async_op, outputs, inputs)


def _rows_per_rank(g: ProcessGroup, what: str, array: Any, sizes: list[int] | None) -> list[Any]:
    """``array`` cut into one block of rows per rank: ``sizes`` rows each, or equal blocks."""
    rows = array.shape[0] if array.ndim else 1
    if sizes is None:
        if rows % g.size:
            raise ValueError(
                f"rank {g.global_rank}: {what} has {rows} rows, not divisible by the group "
                f"size {g.size}; pass {what}_split_sizes"
            )
        return _split_rows(array, g.size) if array.ndim else [array]
    sizes = list(sizes)
    if len(sizes) != g.size or sum(sizes) != rows or any(n < 0 for n in sizes):
        raise ValueError(
            f"rank {g.global_rank}: {what}_split_sizes {sizes} must be {g.size} "
            f"non-negative numbers adding up to the {rows} rows of {what}"
        )
    return _split_by(array, sizes)


def gather(
    array: Any,
    gather_list: list[Any] | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    g = _group(group)
    r = g.global_rank
    check_array(array, "array", r, writable=False)
    _carrier(g, array)
    local = g.group_rank(dst, "dst")
    if g.rank == local:
        if gather_list is None or len(gather_list) != g.size:
            raise ValueError(
                f"rank {r}: gather on the destination rank needs gather_list with {g.size} arrays"
            )
        for i, o in enumerate(gather_list):
            _check_same(array, o, f"gather_list[{i}]", r)
        gather_list = list(gather_list)
    elif gather_list is not None:
        raise ValueError(f"rank {r}: gather_list must be None on ranks other than dst={dst}")
    return _issue(g, "gather", device_of(array), async_op, array, gather_list, local)


def scatter(
    array: Any,
    scatter_list: list[Any] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    g = _group(group)
    r = g.global_rank
    check_array(array, "array", r)
    _carrier(g, array)
    local = g.group_rank(src, "src")
    if g.rank == local:
        if scatter_list is None or len(scatter_list) != g.size:
            raise ValueError(
                f"rank {r}: scatter on the source rank needs scatter_list with {g.size} arrays"
            )
        for i, x in enumerate(scatter_list):
            check_array(x, f"scatter_list[{i}]", r, writable=False)
            if np.dtype(x.dtype) != np.dtype(array.dtype):
                raise TypeError(
                    f"rank {r}: scatter_list[{i}] has dtype {x.dtype}, expected {array.dtype}"
                )
        if scatter_list[local].size != array.size:
            raise ValueError(f"rank {r}: scatter_list[{local}] does not match the output size")
        scatter_list = list(scatter_list)
    elif scatter_list is not None:
        raise ValueError(f"rank {r}: scatter_list must be None on ranks other than src={src}")
    return _issue(g, "scatter", device_of(array), async_op, array, scatter_list, local)


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    g = _group(group)
    device = "cpu" if "cpu" in g.backends else next(iter(g.backends))
    return _issue(g, "barrier", device, async_op)


def _peer(g: ProcessGroup, peer: int, what: str, tag: int) -> int:
    local = g.group_rank(peer, what)
    if local == g.rank:
        raise ValueError(
            f"rank {g.global_rank}: {what}={peer} is this rank itself; point-to-point "
            "operations need another rank"
        )
    if not 0 <= tag < USER_TAG_LIMIT:
        raise ValueError(f"rank {g.global_rank}: tag {tag} must be in [0, {USER_TAG_LIMIT})")
    return local


def send(array: Any, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    g = _group(group)
    check_array(array, "array", g.global_rank, writable=False)
    _carrier(g, array)
    _issue(g, "send", device_of(array), False, array, _peer(g, dst, "dst", tag), tag)


def recv(array: Any, src: int, group: ProcessGroup | None = None, tag: int = 0) -> int:
    g = _group(group)
    check_array(array, "array", g.global_rank)
    _carrier(g, array)
    _issue(g, "recv", device_of(array), False, array, _peer(g, src, "src", tag), tag)
    return src


def isend(array: Any, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Work:
    g = _group(group)
    check_array(array, "array", g.global_rank, writable=False)
    _carrier(g, array)
    return _issue(g, "send", device_of(array), True, array, _peer(g, dst, "dst", tag), tag)


def irecv(array: Any, src: int, group: ProcessGroup | None = None, tag: int = 0) -> Work:
    g = _group(group)
    check_array(array, "array", g.global_rank)
    _carrier(g, array)
    return _issue(g, "recv", device_of(array), True, array, _peer(g, src, "src", tag), tag)


# -- small Python objects -------------------------------------------------------------------------


def broadcast_object(
    obj: Any = None, src: int = 0, group: ProcessGroup | None = None, *, pickle: bool = False
) -> Any:
    """Rank ``src``'s ``obj`` on every rank, for small values: None, bool, int, float, str,
    bytes, list, tuple, dict and numpy arrays (:mod:`pluribus.codec`: data, never code).
    ``pickle=True``, on every rank, carries any picklable object instead; only between ranks
    that trust each other, since unpickling runs what the sender chose."""
    g = _group(group)
    is_src = g.global_rank == src
    payload, refusal = _object_bytes(obj, g, pickle) if is_src else (None, None)
    length = _on_wire(g, np.array([_announced(payload) if is_src else 0], dtype=np.int64))
    broadcast(length, src, g)
    _raise_refusals(g, [int(length[0])], [src], refusal)
    buf = _on_wire(g, payload if is_src else np.empty(int(length[0]), dtype=np.uint8))
    broadcast(buf, src, g)
    return obj if is_src else _object_value(buf, g, pickle, f"rank {src}")


def all_gather_object(
    obj: Any, group: ProcessGroup | None = None, *, pickle: bool = False
) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank; what it carries and ``pickle`` as
    for :func:`broadcast_object`."""
    g = _group(group)
    payload, refusal = _object_bytes(obj, g, pickle)
    lengths = _on_wire(g, np.zeros(g.size, dtype=np.int64))
    all_gather(lengths, _on_wire(g, np.array([_announced(payload)], dtype=np.int64)), g)
    lengths = [int(n) for n in lengths.tolist()]
    _raise_refusals(g, lengths, g.ranks, refusal)
    outputs = [_on_wire(g, np.empty(n, dtype=np.uint8)) for n in lengths]
    all_gather(outputs, _on_wire(g, payload), g)
    return [_object_value(o, g, pickle, f"rank {g.ranks[r]}") for r, o in enumerate(outputs)]


def _on_wire(g: ProcessGroup, host: np.ndarray | None) -> Any:
    """``host`` as ``g`` carries it: a group whose backends take device arrays only (nccl)
    gets a copy on the current device, as torch's object collectives make for NCCL."""
    if host is None or "cpu" in g.backends or g.gpu_staging:
        return host
    import cupy

    return cupy.asarray(host)


#: The length a rank announces for an object it could not encode (then every rank raises).
_REFUSED = -1


def _object_bytes(obj: Any, g: ProcessGroup, use_pickle: bool):
    """``(obj encoded for the wire as a uint8 array, None)``, or ``(None, the TypeError)``
    when it cannot be encoded."""
    try:
        data = _pickle.dumps(obj) if use_pickle else codec.encode(obj, g.global_rank)
    except (TypeError, AttributeError, _pickle.PicklingError) as exc:  # what pickle raises too
        return None, exc
    return np.frombuffer(data, dtype=np.uint8).copy(), None


def _announced(payload: np.ndarray | None) -> int:
    return _REFUSED if payload is None else payload.size


def _raise_refusals(g: ProcessGroup, lengths: list[int], ranks: list[int], mine) -> None:
    """After the lengths went round: this rank's own encoding error, or one naming the rank
    whose object could not be sent (nothing but the lengths was sent)."""
    if mine is not None:
        raise mine
    refused = [r for r, n in zip(ranks, lengths, strict=True) if n == _REFUSED]
    if refused:
        raise TypeError(
            f"rank {g.global_rank}: rank(s) {refused} could not encode their object for an "
            "object collective (their own error says why); nothing else was sent"
        )


def _object_value(buf: Any, g: ProcessGroup, use_pickle: bool, sender: str) -> Any:
    if not isinstance(buf, np.ndarray):  # a device copy (_on_wire)
        buf = buf.get()
    if use_pickle:
        return _pickle.loads(buf.tobytes())  # pickle-by-request
    return codec.decode(buf.tobytes(), g.global_rank, sender)
