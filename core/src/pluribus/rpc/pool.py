"""The bounded pool that runs a worker's handlers, and why nested calls cannot deadlock it.

At most ``size`` handlers run at once. A handler that waits for another call (a nested RPC, a
remote reference's value) gives its place up while it waits: the pool may then start another
thread for the next queued handler, up to ``max_threads`` threads in all (counting handlers run
on a connection's reading thread, ``run_here``). So a chain of calls
between workers (A calls B, whose handler calls A, ...) always finds a thread to run on, and the
number of threads and the memory they hold stay bounded. The same idea as Go's scheduler handing
a blocked thread's processor on, or Java's ForkJoinPool managed blocking.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable

_local = threading.local()


def current_pool() -> HandlerPool | None:
    """The pool whose thread this is, if any."""
    return getattr(_local, "pool", None)


@contextlib.contextmanager
def waiting():
    """Around a wait inside a handler: lets the pool run another handler meanwhile (and, for
    a handler run on a connection's reading thread, lets another thread read on)."""
    pool = current_pool()
    if pool is None:
        yield
        return
    on_wait = getattr(_local, "on_wait", None)
    if on_wait is not None:
        on_wait()
    pool._leave()
    try:
        yield
    finally:
        pool._rejoin()


class HandlerPool:
    """Runs submitted jobs on at most ``size`` running threads (``max_threads`` in all)."""

    def __init__(self, size: int, max_threads: int, name: str, on_thread_start=None):
        self.size = size
        self.max_threads = max(size, max_threads)
        self.name = name
        self._on_thread_start = on_thread_start
        self._jobs: deque[Callable[[], None]] = deque()
        # the counters' lock, taken bare where nobody waits (a Condition's ``with`` runs Python
        # code: a small call passes here twice)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._draining = 0  # threads in ``drain``
        self._threads = 0
        self._idle = 0
        self._active = 0
        self._busy = 0  # running a job, waiting or not
        self._inline = 0  # jobs run on their callers' threads (``run_here``)
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._jobs.append(job)
            self._wake()

    def _wake(self) -> None:
        """With the lock held: get a thread onto the queue's head if one may run."""
        if not self._jobs or self._active >= self.size:
            return
        if self._idle:
            self._cond.notify()
        elif self._threads + self._inline < self.max_threads:
            self._threads += 1
            threading.Thread(
                target=self._run, name=f"{self.name}-{self._threads}", daemon=True
            ).start()

    def run_here(self, job: Callable[[], None], on_wait: Callable[[], None]) -> bool:
        """Run ``job`` on the calling thread when a place is free and nothing is queued (no
        hand-over to a pool thread); False, without running it, otherwise. ``on_wait`` is
        called if the job waits for another call."""
        with self._lock:
            if (
                self._closed
                or self._jobs
                or self._active >= self.size
                or self._threads + self._inline >= self.max_threads
            ):
                return False
            self._active += 1
            self._busy += 1
            self._inline += 1
        local = _local
        local.pool, local.on_wait = self, on_wait
        try:
            job()
        except BaseException:  # a job reports its own errors
            pass
        finally:
            local.pool = local.on_wait = None
            with self._lock:
                self._active -= 1
                self._busy -= 1
                self._inline -= 1
                if self._jobs:
                    self._wake()
                if self._draining:
                    self._cond.notify_all()
        return True

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            self._wake()

    def _rejoin(self) -> None:
        with self._lock:
            self._active += 1

    def _run(self) -> None:
        _local.pool = self
        if self._on_thread_start is not None:
            self._on_thread_start()
        with self._cond:
            while True:
                while not self._closed and (not self._jobs or self._active >= self.size):
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._jobs:  # closed and drained
                    self._threads -= 1
                    self._cond.notify_all()
                    return
                job = self._jobs.popleft()
                self._active += 1
                self._busy += 1
                self._cond.release()
                try:
                    job()
                except BaseException:  # a job reports its own errors; the thread must live on
                    pass
                finally:
                    job = None  # an idle thread must not keep the last call's arguments alive
                    self._cond.acquire()
                    self._active -= 1
                    self._busy -= 1
                    self._cond.notify_all()
                    self._wake()

    def drain(self, deadline: float) -> bool:
        """Wait until no job is queued or running; False if ``deadline`` came first."""
        with self._cond:
            self._draining += 1
            try:
                while self._jobs or self._busy:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._draining -= 1

    def close(self) -> None:
        """Drop queued jobs and let idle threads end; running handlers finish on their own."""
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()
