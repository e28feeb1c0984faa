"""MPI requests as pluribus Work: waiting polls the request with ``Test``, spinning for about as
long as the transfer should take, then sleeping with a growing back-off, so that a rank waiting
for a late peer leaves its CPU to the others and every wait has a timeout (MPI itself has none).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pluribus.arrival import absent_ranks, explain
from pluribus.errors import DistTimeoutError, PluribusError
from pluribus.work import Work

from .datatypes import MPI

if TYPE_CHECKING:
    from .backend import MPIBackend

#: A wait spins on ``Test`` for about as long as the transfer itself should take (MPI makes
#: progress only inside MPI calls, as its own blocking calls do by spinning), at least
#: ``SPIN_MIN_SECONDS`` and at most ``SPIN_MAX_SECONDS``; only then does it sleep between tests.
SPIN_MIN_SECONDS = float(os.environ.get("PLURIBUS_MPI_SPIN_US", "1000")) * 1e-6
SPIN_MAX_SECONDS = 0.05
SPIN_SECONDS_PER_BYTE = 2e-9  # 0.5 GB/s: slow enough for a loaded node
#: While spinning, yield the CPU every this many tests (cheap when no other thread wants it).
YIELD_EVERY = 64
#: Sleeps between ``Test`` calls grow to at most this, and to at most 1/16 of the time waited.
MAX_SLEEP_SECONDS = 1e-3

#: Collectives whose wait timed out while their request was still posted (kept, with their
#: buffers, which MPI may still write). MPI cannot cancel a collective, and MPI_Finalize waits
#: for every posted one: see ``failure.exit_if_stuck``.
LEFT_POSTED: set[MPIWork] = set()


def describe(name: str, key_array: Any, group_name: str) -> str:
    if key_array is None:
        return f"{name} on group {group_name!r}"
    return (
        f"{name}(shape={tuple(key_array.shape)}, dtype={key_array.dtype}) on group {group_name!r}"
    )


NOT_STARTED = ": another rank of the group has not started the same operation (or died)"


def who_did_not_arrive(backend: MPIBackend, seq: int, limit: float) -> str:
    """The end of a timeout message naming the ranks that never reached collective ``seq`` of
    ``backend``'s group: every rank that did says so in the group's store when its own wait
    runs out (as gloo and ucc do)."""
    if backend.store is None:
        return NOT_STARTED
    try:
        found = absent_ranks(backend.store, f"reached/{seq}", backend.rank, backend.size)
        missing: list[int] | None = [backend.world_ranks[r] for r in found]
    except Exception:
        missing = None
    return explain(missing, limit)


class Pending:
    """A request in flight, the callbacks that finish the operation, and the arrays it uses."""

    __slots__ = ("request", "status", "finishers", "keep", "seq")

    def __init__(self, request: Any, keep: tuple = (), status: Any = None):
        self.request = request
        self.status = status
        self.finishers: list[Callable[[], None]] = []
        self.keep = keep
        self.seq = 0  # the collective's number in its group; 0 for point-to-point


class MPIWork(Work):
    """A Work around MPI requests. ``wait(timeout)`` polls them and raises DistTimeoutError."""

    def __init__(self, backend: MPIBackend, pending: Pending, name: str, key_array: Any = None):
        self.backend = backend
        self.pending = pending
        self.name = name
        self.key_array = key_array
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[MPIWork], None]] = []

    @property
    def description(self) -> str:
        return describe(self.name, self.key_array, self.backend.group_name)

    def _finish(self, error: BaseException | None = None) -> None:
        if error is None:
            try:
                for finish in self.pending.finishers:
                    finish()
            except BaseException as exc:
                error = exc
        self._error = error
        self._done = True
        LEFT_POSTED.discard(self)
        self.pending.keep = ()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def add_done_callback(self, callback: Callable[[MPIWork], None]) -> None:
        """Call ``callback(work)`` when a wait or test sees the work finish (at once if it has).

        MPI completes requests only inside MPI calls, so this runs in the thread that waits.
        """
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def _poll(self) -> bool:
        """Test once; True when finished (successfully or not)."""
        if self._done:
            return True
        try:
            done = self.pending.request.Test(self.pending.status)
        except MPI.Exception as exc:
            self._finish(self.backend.translate(exc, self.description))
            return True
        if done:
            self._finish()
        return done

    def wait(self, timeout: float | None = None) -> bool:
        limit = self.backend.timeout if timeout is None else float(timeout)
        with self._lock:
            if not self._poll():
                self._wait_polling(limit, ask_who=timeout is None)
        if self._error is not None:
            raise self._error
        return True

    def _wait_polling(self, limit: float, ask_who: bool) -> None:
        start = time.monotonic()
        nbytes = getattr(self.key_array, "nbytes", 0)
        spin = min(SPIN_MIN_SECONDS + nbytes * SPIN_SECONDS_PER_BYTE, SPIN_MAX_SECONDS, limit)
        spin_until = start + spin
        polls = 0
        while time.monotonic() < spin_until:
            if self._poll():
                return
            polls += 1
            if polls % YIELD_EVERY == 0:
                os.sched_yield()  # let a rank sharing this core run (oversubscribed jobs)
        deadline = start + limit
        delay = 50e-6
        while not self._poll():
            now = time.monotonic()
            if self.backend.aborted is not None:
                raise PluribusError(
                    f"rank {self.backend.rank}: {self.description} was stopped because "
                    f"{self.backend.aborted}"
                )
            if now >= deadline:
                raise self._timed_out(limit, ask_who)
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, MAX_SLEEP_SECONDS, max(50e-6, (now - start) / 16))

    def _timed_out(self, limit: float, ask_who: bool) -> DistTimeoutError:
        """The error of a wait that ran out: for a collective waited for with the group's
        timeout, which ranks never reached it (asked through the group's store, as gloo and
        ucc do). The request stays posted (:data:`LEFT_POSTED`)."""
        backend, seq = self.backend, self.pending.seq
        if seq:  # a posted receive does not hold MPI_Finalize up; a collective does
            LEFT_POSTED.add(self)
        where, who = "", NOT_STARTED
        if seq:
            where = f" (#{seq} of this group)"
            if ask_who:
                who = who_did_not_arrive(backend, seq, limit)
        return DistTimeoutError(
            f"rank {backend.world_ranks[backend.rank]}: {self.description}{where} did not "
            f"complete within {limit:.1f}s{who}. "
            "MPI cannot cancel it: wait again to let it finish; if it never will, end the "
            "process (it exits without MPI_Finalize, which would wait for it forever, and "
            "mpiexec ends the other ranks)"
        )

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._poll()
        finally:
            self._lock.release()

    def exception(self) -> BaseException | None:
        return self._error if self.is_completed() else None

    def result(self) -> Any:
        self.wait()
        return None
