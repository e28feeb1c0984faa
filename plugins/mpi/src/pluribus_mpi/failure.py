"""What happens when something fails on MPI: the watchdog that ends the job when a blocking call
outlives its timeout (MPI cannot cancel one), raising on every rank when any rank found a problem
at start-up, MPI_Abort on an uncaught exception so that no rank waits for a dead one, and an exit
without MPI_Finalize when a collective that timed out is still posted."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from pluribus.errors import DistTimeoutError, PluribusError

from . import deathwatch
from .datatypes import MPI
from .work import LEFT_POSTED, describe, who_did_not_arrive

if TYPE_CHECKING:
    from .backend import MPIBackend

#: ``PLURIBUS_MPI_ABORT_ON_ERROR=0`` keeps the default ``sys.excepthook`` (no MPI_Abort).
ABORT_ENV = "PLURIBUS_MPI_ABORT_ON_ERROR"
#: How often the watchdog looks at a blocking call's deadline, in seconds.
WATCHDOG_PERIOD = 0.25


def watch_blocking_calls(backend: MPIBackend) -> None:
    """The watchdog thread of ``backend``: end the job when one blocking call has run for the
    timeout (give or take a period:
    a call is timed from when the watchdog first sees it)."""
    seen, since = None, 0.0
    while not backend.closed:
        time.sleep(WATCHDOG_PERIOD)
        watched = backend._watched
        if watched is not seen:  # no call, or another one: ``seen`` keeps it alive
            seen, since = watched, time.monotonic()
            continue
        if watched is None or time.monotonic() - since < backend.timeout:
            continue
        error = _timeout_error(backend, watched, backend.seq)
        if backend._watched is not watched:
            continue  # it completed while the store was asked: the last rank arrived
        report = (
            f"pluribus-mpi: {type(error).__name__}: {error}\n"
            f"pluribus-mpi: rank {backend.rank} calls MPI_Abort to end all ranks (MPI cannot "
            "cancel a blocking collective)\n"
        )
        try:
            os.write(2, report.encode(errors="replace"))
        except OSError:
            pass
        deathwatch.farewell()  # this rank said why it ends
        time.sleep(0.2)  # let mpiexec forward the report
        MPI.COMM_WORLD.Abort(1)
        return


def _timeout_error(backend: MPIBackend, watched: tuple[str, Any], seq: int) -> DistTimeoutError:
    """The error of blocking call ``watched``, collective ``seq`` of its group (the call holds
    the group's start lock, so no other collective has taken a number since), naming the ranks
    that never reached it: every rank that did says so in the group's store when its own
    watchdog expires, as waits that poll a request do (``work.MPIWork``)."""
    description = describe(watched[0], watched[1], backend.group_name)
    who = who_did_not_arrive(backend, seq, backend.timeout)
    return DistTimeoutError(
        f"rank {backend.world_ranks[backend.rank]}: {description} (#{seq} of this group) did "
        f"not complete within {backend.timeout:.1f}s{who}"
    )


def raise_if_any(comm: Any, problem: str | None, what: str) -> None:
    """Raise on every rank when any rank found a ``problem`` (so that none waits for it).

    The texts travel as bytes in MPI buffers, not through mpi4py's pickled ``allgather``:
    nothing here unpickles what another process sent."""
    problems = [p for p in _allgather_text(comm, problem or "") if p]
    if problem:
        raise PluribusError(problem)
    if problems:
        raise PluribusError(
            f"rank {comm.Get_rank()}: could not {what} because another rank failed: {problems[0]}"
        )


def _allgather_text(comm: Any, text: str) -> list[str]:
    """Every rank's ``text``, in rank order, through MPI buffers (lengths, then the bytes)."""
    data = np.frombuffer(text.encode(errors="replace"), dtype=np.uint8)
    lengths = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([data.size], dtype=np.int64), lengths)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    gathered = np.empty(int(lengths.sum()), dtype=np.uint8)
    comm.Allgatherv(data, [gathered, lengths, offsets, MPI.BYTE])
    return [
        gathered[start : start + length].tobytes().decode(errors="replace")
        for start, length in zip(offsets.tolist(), lengths.tolist(), strict=True)
    ]


def abort_on_error_default() -> bool:
    return os.environ.get(ABORT_ENV, "1").strip().lower() not in ("0", "false", "no")


_hook_lock = threading.Lock()
_previous_hook: Callable | None = None


def install_excepthook() -> None:
    """On an uncaught exception print the traceback, then MPI_Abort the whole job, so that the
    other ranks do not wait forever for this one (what ``python -m mpi4py`` does)."""
    global _previous_hook
    with _hook_lock:
        if _previous_hook is not None:
            return
        _previous_hook = sys.excepthook
        sys.excepthook = _abort_on_uncaught


def uninstall_excepthook() -> None:
    global _previous_hook
    with _hook_lock:
        if _previous_hook is not None and sys.excepthook is _abort_on_uncaught:
            sys.excepthook = _previous_hook
        _previous_hook = None


def _abort_on_uncaught(exc_type, exc, tb) -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    message = f"pluribus-mpi: uncaught exception on rank {rank} of {size}:\n{text}"
    aborting = size > 1 and MPI.Is_initialized() and not MPI.Is_finalized()
    if aborting:
        message += f"pluribus-mpi: rank {rank} calls MPI_Abort to end all {size} ranks\n"
    if _previous_hook not in (None, sys.__excepthook__):
        try:  # a hook someone else installed (an error-file writer, say) still runs
            _previous_hook(exc_type, exc, tb)
        except BaseException:
            pass
    sys.stdout.flush()
    # One write, so that mpiexec forwards the whole report before MPI_Abort ends the job.
    try:
        sys.stderr.flush()
        os.write(2, message.encode(errors="replace"))
    except OSError:
        pass
    if aborting:
        deathwatch.farewell()  # this rank said why it ends
        time.sleep(0.2)  # let mpiexec's output forwarding drain before every rank is killed
        world.Abort(1)


_exit_check = False


def install_exit_check() -> None:
    """Run :func:`exit_if_stuck` at interpreter exit (once per process). Python's atexit
    functions run before mpi4py's MPI_Finalize, which it registers with ``Py_AtExit``."""
    global _exit_check
    with _hook_lock:
        if not _exit_check:
            _exit_check = True
            atexit.register(exit_if_stuck)


def exit_if_stuck() -> None:
    """End this process without MPI_Finalize when a collective that timed out is still posted.

    MPI cannot cancel a collective, and MPI_Finalize waits for every posted one: a rank whose
    peer never arrived (and MPI_Abort is off) would otherwise hang at exit until that peer
    ended. Exiting without MPI_Finalize is an abnormal end, so mpiexec ends the other ranks."""
    stuck = [work for work in list(LEFT_POSTED) if not work.is_completed()]
    if not stuck or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    rank = MPI.COMM_WORLD.Get_rank()
    calls = ", ".join(work.description for work in stuck)
    message = (
        f"pluribus-mpi: rank {rank} exits without MPI_Finalize (exit code 1): {calls} timed out "
        "and is still posted, and MPI_Finalize would wait for it until every rank reached it; "
        "mpiexec ends the other ranks\n"
    )
    deathwatch.farewell()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, message.encode(errors="replace"))
    except (OSError, ValueError):
        pass
    os._exit(1)


def unlink_shared_memory_names() -> list[str]:
    """Remove the names of the /dev/shm segments MPI mapped into this process at start-up.

    MPICH unlinks its shared-memory segment only when the job ends cleanly, so every abnormal
    end (a killed rank, MPI_Abort) left one behind. Once every rank of the job has started (the
    caller has completed a collective on the world), every rank on this host has the segment
    mapped: the name is no longer needed, and the memory goes away with the last process that
    maps it. Only segments mapped by this process are touched, never another job's.
    """
    removed = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if " /dev/shm/mpich" in line}
    except OSError:
        return removed
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass  # another rank of this host was first
    return removed
