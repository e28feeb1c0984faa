"""ProcessGroup: the user-facing handle of a set of ranks, their backends and their work queue."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from . import plugins
from .arrays import device_of
from .backend import Backend
from .builtin import collectives
from .errors import PeerError, PluribusError
from .lifeline import Lifeline, WatchedStore
from .operations import OPERATIONS
from .store import Store
from .work import CompletedWork, FutureWork, Work

GPU_STAGING_ENV = "PLURIBUS_GPU_STAGING"


class ProcessGroup:
    """Ranks that run collectives together.

    ``ranks`` are the members' global ranks, ``rank`` is this process's rank within the group.
    ``backends`` maps a device ("cpu", "cuda") to the backend that carries its arrays, so one
    group can send numpy arrays through gloo and cupy arrays through NCCL. Operations on one
    group complete in the order issued: asynchronous ones run on the group's worker thread, and a
    synchronous one runs at once only when nothing is queued before it.
    """

    def __init__(
        self,
        name: str,
        ranks: list[int],
        rank: int,
        backends: dict[str, Backend],
        timeout: float,
        store: Store,
        gpu_staging: bool | None = None,
        lifeline: Lifeline | None = None,
        stores: list[WatchedStore] | None = None,
    ):
        self.name = name
        self.ranks = list(ranks)
        self.rank = rank
        self.size = len(ranks)
        self.backends = backends
        self.timeout = timeout
        self.store = store
        if gpu_staging is None:
            gpu_staging = os.environ.get(GPU_STAGING_ENV, "") not in ("", "0")
        self.gpu_staging = gpu_staging
        self.closed = False
        self._lock = threading.Lock()
        self._lanes: dict[Any, _Lane] = {}
        self._subgroups = 0
        #: (array type, dtype, id(op)) combinations the public API has checked, with their device
        self.checked_ops: dict[tuple[Any, Any, Any], str] = {}
        #: The public collectives' shortcuts, by operation name: (array type, dtype, op or
        #: None, plugin generation, direct function) of the last synchronous call checked whose
        #: operation has a direct function (see ``distributed._shortcut``). Emptied on a
        #: failure and on close, so that those calls take the path that raises.
        self.shortcuts: dict[str, tuple[Any, Any, Any, int, Callable[..., None]]] = {}
        self._direct: dict[tuple[str, str], Callable[..., None] | None] = {}
        self._direct_generation = -1
        #: Whether the core watches this group's calls (see ``Backend.detects_failures`` and
        #: ``abort_wakes_calls``): they run on the worker thread, and the caller waits at most
        #: ``timeout`` and hears at once of a peer's failure through the world's lifelines.
        self.watched = any(
            not (b.detects_failures or b.abort_wakes_calls) for b in backends.values()
        )
        self.lifeline = lifeline
        #: The stores handed to this group's backends that leave failures to the core
        #: (``BackendContext.store``): a failure ends their waits, after the backends' ``abort``.
        self.stores = list(stores or ())
        #: The error every call raises once a member failed or this rank aborted the group.
        self.failure: PluribusError | None = None
        if lifeline is not None:
            lifeline.add_listener(self._peer_failed)

    def __repr__(self) -> str:
        return (
            f"ProcessGroup(name={self.name!r}, rank={self.rank}, size={self.size}, "
            f"backend={self.backend_name!r})"
        )

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    @property
    def backend_name(self) -> str:
        names = {f"{dev}:{b.name}" for dev, b in self.backends.items()}
        if len({b.name for b in self.backends.values()}) == 1:
            return next(iter(self.backends.values())).name
        return ",".join(sorted(names))

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """The group-local rank of ``global_rank``; a clear error when it is not a member."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(
                f"rank {self.global_rank}: {what}={global_rank} is not a member of group "
                f"{self.name!r} (its global ranks are {self.ranks})"
            ) from None

    def backend_for(self, array: Any) -> Backend:
        """The backend that carries ``array``; with host staging, the cpu one for a cupy array."""
        device = device_of(array)
        backend = self.backends.get(device)
        if backend is not None:
            return backend
        if device == "cuda" and self.gpu_staging and "cpu" in self.backends:
            return self.backends["cpu"]
        carried = ", ".join(f"{d} ({b.name})" for d, b in self.backends.items())
        hint = (
            f"set {GPU_STAGING_ENV}=1 to copy through host memory, or create the group with "
            'backend="cpu:gloo,cuda:nccl" to send cupy arrays through NCCL'
            if device == "cuda"
            else 'create the group with backend="cpu:gloo,cuda:nccl" to carry numpy arrays too'
        )
        raise TypeError(
            f"rank {self.global_rank}: group {self.name!r} carries only {carried} arrays, got a "
            f"{device} array; {hint}"
        )

    def direct(self, name: str, device: str) -> Callable[..., None] | None:
        """The function running synchronous ``name`` calls for ``device`` arrays without pluggy,
        or None when any other plugin implements or wraps the hook (it must see every call) or
        the core must decide per call. Made once per operation and device, again whenever the
        plugins change."""
        generation = plugins.generation
        if generation != self._direct_generation:
            self._direct = {}
            self._direct_generation = generation
        key = (name, device)
        try:
            return self._direct[key]
        except KeyError:
            op = OPERATIONS[name]
            found = None
            if self.failure is None and plugins.core_only(op.hook_name):
                found = collectives.direct(self, op, device)
            self._direct[key] = found
            return found

    def lane(self, name: Any = "collectives") -> _Lane:
        """The ordered queue ``name`` (made on first use); see :meth:`submit`."""
        found = self._lanes.get(name)
        if found is None:
            with self._lock:
                found = self._lanes.get(name)
                if found is None:
                    found = self._lanes[name] = _Lane(f"pluribus-{self.name}-{name}")
        return found

    def submit(
        self,
        fn: Callable[[], Any],
        async_op: bool,
        description: str | Callable[[], str],
        lane: Any = "collectives",
    ) -> Work:
        """Run ``fn`` after every operation issued before it on the same ``lane``.

        Collectives share one lane; point-to-point operations get a lane per direction and peer,
        so that ``isend`` to a peer and ``recv`` from it do not wait on each other.
        ``description`` (or a function making it, to keep the fast path cheap) names the
        operation in errors.
        """
        if self.closed:
            raise PluribusError(f"rank {self.global_rank}: group {self.name!r} was destroyed")
        if self.failure is not None:
            raise self.failure_again()
        return self.lane(lane).submit(
            fn, async_op, description, self.global_rank, self.timeout, self.watched
        )

    def failure_again(self) -> PluribusError:
        """A fresh copy of :attr:`failure` to raise (one object raised in many threads would
        collect their tracebacks)."""
        failure = self.failure
        if isinstance(failure, PeerError):
            return PeerError(str(failure), failure.peer)
        return PluribusError(str(failure))

    def _peer_failed(self, peer: int, reason: str) -> None:
        """A lifeline heard that global rank ``peer`` failed: stop this group's calls."""
        if peer not in self.ranks or self.failure is not None:
            return
        error = PeerError(
            f"rank {self.global_rank}: rank {peer} {reason}; the operations of group "
            f"{self.name!r} cannot complete. Restart the job (pluribus-run restarts it when given "
            "--max-restarts)",
            peer,
        )
        self._fail(error, f"rank {peer} {reason}")

    def _fail(self, error: PluribusError, reason: str) -> None:
        self.failure = error
        self.shortcuts = {}  # calls now take the hook path, which raises the failure
        self._direct_generation = -1
        for backend in self._distinct_backends():
            backend.end_sendrecv_waits(error)
            try:
                backend.abort(reason)
            except Exception:  # the waiting calls below are failed regardless
                pass
        for store in self.stores:
            store.abort(reason)
        for lane in list(self._lanes.values()):
            lane.fail(error)

    def abort(self, reason: str) -> None:
        """Stop this group on this rank after a failure: every waiting and later call raises,
        the backends' ``abort`` is called, and the other ranks are told why (they raise
        PeerError naming this rank)."""
        if self.lifeline is not None:
            self.lifeline.abort(f"rank {self.global_rank}: {reason}")
        if self.failure is None:
            error = PluribusError(
                f"rank {self.global_rank}: group {self.name!r} was aborted: {reason}"
            )
            self._fail(error, reason)

    def _distinct_backends(self) -> list[Backend]:
        seen: dict[int, Backend] = {}
        for backend in self.backends.values():
            seen.setdefault(id(backend), backend)
        return list(seen.values())

    def next_subgroup_name(self) -> str:
        with self._lock:
            self._subgroups += 1
            return f"{self.name}.{self._subgroups}"

    def close(self) -> None:
        """Finish queued work, then close this group's backends (not the store)."""
        if self.closed:
            return
        self.closed = True
        self.shortcuts = {}
        # After a failure a worker may be stuck in a backend's wait: do not wait for it.
        for lane in list(self._lanes.values()):
            lane.close(self.timeout if self.failure is None else 0.5)
        if self.lifeline is not None:
            self.lifeline.remove_listener(self._peer_failed)
        for backend in self._distinct_backends():
            backend.close()


class _Lane:
    """An ordered queue of operations with a worker thread started on first use."""

    def __init__(self, name: str):
        self.name = name
        self.lock = threading.Lock()
        self.exec_lock = threading.Lock()
        self.pending = 0
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.worker: threading.Thread | None = None
        self.outstanding: set[FutureWork] = set()

    def submit(
        self, fn, async_op: bool, description, rank: int, timeout: float, queued: bool = False
    ) -> Work:
        """Run ``fn`` in order; a synchronous call runs on the calling thread when nothing is
        queued, unless ``queued`` (then the caller waits on the Work, which a failure can end)."""
        with self.lock:
            inline = not async_op and self.pending == 0 and not queued
            if not inline:
                self.pending += 1
                work = FutureWork(_described(rank, description), timeout)
                self.outstanding.add(work)
                self.queue.put((fn, work))
                if self.worker is None:
                    self.worker = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self.worker.start()
        if inline:
            with self.exec_lock:
                return CompletedWork(fn())
        if not async_op:
            work.wait()
        return work

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            fn, work = item
            try:
                with self.exec_lock:
                    value = fn()
            except BaseException as exc:
                work.set_exception(exc)
            else:
                work.set_result(value)
            finally:
                with self.lock:
                    self.pending -= 1
                    self.outstanding.discard(work)

    def fail(self, error: BaseException) -> None:
        """End every queued or running Work with ``error`` (their jobs may still finish)."""
        with self.lock:
            works = list(self.outstanding)
        for work in works:
            work.set_exception(error)

    def close(self, timeout: float) -> None:
        if self.worker is not None:
            self.queue.put(None)
            self.worker.join(timeout)


def _described(rank: int, description: str | Callable[[], str]) -> Callable[[], str]:
    """The description of a queued call, made only if an error needs it."""
    if callable(description):
        return lambda: f"rank {rank}: {description()}"
    return lambda: f"rank {rank}: {description}"


class _NonMember:
    """What ``new_group`` returns on ranks outside the group; every collective refuses it."""

    def __repr__(self) -> str:
        return "NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonMember()
