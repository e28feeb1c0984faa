"""Run a function on N ranks: threads of this process, spawned processes, or an MPI job.

Processes are spawned (never forked: the parent has threads), rendezvous through a TCPStore
served by the parent on a free port, and are always killed when the pool closes. A pool keeps its
ranks alive between calls so that a suite pays the start-up once; after a failure it restarts
them, because a failed collective may leave the group in an unknown state.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..store import HashStore, TCPStore

#: Extra seconds the other ranks get to report their own error after the first one fails.
FAILURE_GRACE = 10.0


@dataclass
class RankError:
    rank: int
    kind: str  # exception type name, or "died" / "timeout"
    message: str
    traceback: str = ""


class RanksFailed(AssertionError):
    """One or more ranks raised, died or timed out. ``errors`` has one entry per failed rank."""

    def __init__(self, errors: list[RankError]):
        self.errors = sorted(errors, key=lambda e: e.rank)
        lines = [f"{len(self.errors)} rank(s) failed:"]
        for e in self.errors:
            lines.append(f"--- rank {e.rank}: {e.kind}: {e.message}")
            if e.traceback:
                lines.append(e.traceback.rstrip())
        super().__init__("\n".join(lines))

    def kinds(self) -> dict[int, str]:
        return {e.rank: e.kind for e in self.errors}


def _abort_group(reason: str) -> None:
    """Tell this rank's backends to stop waiting so that its peers fail fast, not at timeout."""
    import pluribus

    if pluribus.is_initialized():
        try:
            pluribus.get_default_group().abort(reason)
        except Exception:
            pass


def _call(fn: Callable, args: tuple, rank: int) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except BaseException as exc:
        _abort_group(f"rank {rank} raised {type(exc).__name__}: {exc}")
        return "error", RankError(rank, type(exc).__name__, str(exc), traceback.format_exc())


# -- threads ------------------------------------------------------------------------------------


class _ThreadRanks:
    def __init__(self, world_size, backend, timeout, backend_options):
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.backend_options = backend_options

    def run(self, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        import pluribus

        store = HashStore(timeout=self.timeout)
        results: list[Any] = [None] * self.world_size
        errors: list[RankError] = []

        def rank_main(rank: int) -> None:
            try:
                pluribus.init_process_group(
                    self.backend,
                    rank=rank,
                    world_size=self.world_size,
                    store=store,
                    timeout=self.timeout,
                    backend_options=self.backend_options,
                )
            except BaseException as exc:
                errors.append(RankError(rank, type(exc).__name__, str(exc), traceback.format_exc()))
                return
            try:
                status, value = _call(fn, args, rank)
                if status == "ok":
                    results[rank] = value
                else:
                    errors.append(value)
            finally:
                pluribus.destroy_process_group()

        threads = [
            threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True)
            for r in range(self.world_size)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        for r in stuck:
            errors.append(RankError(r, "timeout", f"still running after {timeout:.0f}s"))
        if errors:
            raise RanksFailed(errors)
        return results

    def close(self) -> None:
        pass


# -- processes ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _environment(changes: dict[str, str]):
    """Set environment variables for the duration (a spawned child inherits them at start)."""
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _process_main(conn, rank, world_size, backend, port, timeout, backend_options):
    import pluribus

    try:
        store = TCPStore("127.0.0.1", port, timeout=timeout)
        pluribus.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            store=store,
            timeout=timeout,
            backend_options=backend_options,
        )
    except BaseException as exc:
        conn.send(("error", RankError(rank, type(exc).__name__, str(exc), traceback.format_exc())))
        return
    conn.send(("ready", None))
    try:
        while True:
            job = conn.recv()
            if job is None:
                break
            fn, args = job
            status, value = _call(fn, args, rank)
            conn.send((status, value))
            if status != "ok":
                break
    finally:
        pluribus.destroy_process_group()
        store.close()


class _ProcessRanks:
    def __init__(self, world_size, backend, timeout, env, backend_options):
        self.world_size = world_size
        self.timeout = timeout
        ctx = multiprocessing.get_context("spawn")
        self.store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout)
        self.procs = []
        self.conns = []
        child_env = dict(env or {})
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_process_main,
                args=(
                    child_end,
                    rank,
                    world_size,
                    backend,
                    self.store.port,
                    timeout,
                    backend_options,
                ),
                name=f"pluribus-rank{rank}",
                daemon=True,
            )
            with _environment(child_env):  # before the child imports numpy (BLAS threads)
                proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        self.broken = False
        try:
            self._collect("start-up", time.monotonic() + timeout + 30)
        except BaseException:
            self.close()
            raise

    def _collect(self, what: str, deadline: float) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors: dict[int, RankError] = {}
        waiting = set(range(self.world_size))
        first_failure: float | None = None
        while waiting:
            now = time.monotonic()
            limit = (
                deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE)
            )
            if now >= limit:
                break
            for rank in sorted(waiting):
                conn, proc = self.conns[rank], self.procs[rank]
                if conn.poll(0.02):
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        status, value = "died", None
                    if status in ("ok", "ready"):
                        results[rank] = value
                    elif status == "error":
                        errors[rank] = value
                    else:
                        errors[rank] = self._death(rank)
                    waiting.discard(rank)
                elif not proc.is_alive() and not conn.poll(0):
                    errors[rank] = self._death(rank)
                    waiting.discard(rank)
                if errors and first_failure is None:
                    first_failure = time.monotonic()
        for rank in waiting:
            errors[rank] = RankError(rank, "timeout", f"{what} still running when stopped")
        if errors:
            self.broken = True
            raise RanksFailed(list(errors.values()))
        return results

    def _death(self, rank: int) -> RankError:
        proc = self.procs[rank]
        proc.join(1.0)
        code = proc.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return RankError(rank, "died", f"process exited ({how}) without reporting")

    def run(self, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        for conn in self.conns:
            conn.send((fn, args))
        return self._collect(getattr(fn, "__name__", "job"), time.monotonic() + timeout)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.store.close()


# -- an MPI job: this process is one rank ---------------------------------------------------------


class _InplaceRank:
    """Under mpiexec every pytest process is one rank: run the function here, on the job's world."""

    def __init__(self, backend, timeout, backend_options):
        import pluribus

        if not pluribus.is_initialized():
            pluribus.init_process_group(backend, timeout=timeout, backend_options=backend_options)
        self.world_size = pluribus.get_world_size()

    def run(self, fn: Callable, args: tuple, timeout: float) -> list[Any]:
        import pluribus

        status, value = _call(fn, args, pluribus.get_rank())
        if status != "ok":
            raise RanksFailed([value])
        return [value]

    def close(self) -> None:
        pass


class RankPool:
    """Ranks kept alive between calls. ``pool.run(fn, *args)`` returns each rank's result.

    ``mode`` is "threads", "processes" or "inplace" (this process is a rank of an MPI job);
    the default is "threads" for the threads backend and "processes" otherwise. ``fn`` runs after
    ``init_process_group``; in process mode it must be importable (defined at module level).
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "threads",
        mode: str | None = None,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
        backend_options: dict[str, Any] | None = None,
    ):
        self.world_size = world_size
        self.backend = backend
        names = {part.rpartition(":")[2] for part in backend.split(",")}
        self.mode = mode or ("threads" if names == {"threads"} else "processes")
        self.timeout = timeout
        self.env = env
        self.backend_options = backend_options
        self._ranks = None

    def _ensure(self):
        if self._ranks is None or getattr(self._ranks, "broken", False):
            if self._ranks is not None:
                self._ranks.close()
            if self.mode == "threads":
                self._ranks = _ThreadRanks(
                    self.world_size, self.backend, self.timeout, self.backend_options
                )
            elif self.mode == "processes":
                self._ranks = _ProcessRanks(
                    self.world_size, self.backend, self.timeout, self.env, self.backend_options
                )
            elif self.mode == "inplace":
                self._ranks = _InplaceRank(self.backend, self.timeout, self.backend_options)
            else:
                raise ValueError(f"mode must be threads, processes or inplace, not {self.mode!r}")
        return self._ranks

    def run(self, fn: Callable, *args: Any, timeout: float | None = None) -> list[Any]:
        return self._ensure().run(fn, args, self.timeout if timeout is None else timeout)

    def close(self) -> None:
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_ranks(
    fn: Callable,
    world_size: int,
    backend: str = "threads",
    mode: str | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    args: tuple = (),
    backend_options: dict[str, Any] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on every rank of a fresh world and return the results in rank order.

    Raises :class:`RanksFailed` naming every rank that raised, died or timed out; child
    processes are always stopped before this returns.
    """
    with RankPool(world_size, backend, mode, timeout, env, backend_options) as pool:
        return pool.run(fn, *args)
