"""Handles for operations in flight (torch.distributed's ``Work``)."""

from __future__ import annotations

import _thread
from collections.abc import Callable
from typing import Any

from .errors import DistTimeoutError


class Work:
    """An operation that may still be running. ``wait`` raises the operation's error, if any."""

    def wait(self, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> Any:
        self.wait()
        return None


class CompletedWork(Work):
    """A Work for an operation that already finished (synchronous calls return one)."""

    def __init__(self, value: Any = None):
        self._value = value

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def result(self) -> Any:
        return self._value


class FutureWork(Work):
    """A Work completed by another thread through ``set_result`` or ``set_exception``.

    Waiting is one lock acquire (a latch: held until the work finishes), not an Event's
    condition variable: a synchronous call that the core hands to a group's worker thread waits
    on one of these, and the hand-off is a large part of such a call's cost. ``description`` may
    be a function making it, called only when an error needs it.
    """

    def __init__(
        self,
        description: str | Callable[[], str] = "operation",
        default_timeout: float | None = None,
    ):
        self._description = description
        self.default_timeout = default_timeout
        self._latch = _thread.allocate_lock()
        self._latch.acquire()
        self._finished = False
        self._error: BaseException | None = None
        self._value: Any = None
        self._callbacks: list[Callable[[FutureWork], None]] = []
        self._lock = _thread.allocate_lock()

    @property
    def description(self) -> str:
        if callable(self._description):
            self._description = self._description()
        return self._description

    def set_result(self, value: Any = None) -> None:
        self._finish(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, value: Any, error: BaseException | None) -> None:
        """The first outcome stands (a peer's failure may end a work before its job does)."""
        with self._lock:
            if self._finished:
                return
            self._value, self._error = value, error
            self._finished = True
            self._latch.release()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def add_done_callback(self, callback: Callable[[FutureWork], None]) -> None:
        """Call ``callback(work)`` when the work finishes (at once if it already has)."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(callback)
                return
        callback(self)

    def wait(self, timeout: float | None = None) -> bool:
        if not self._finished:
            limit = self.default_timeout if timeout is None else timeout
            if not self._latch.acquire(timeout=_lock_timeout(limit)):
                raise DistTimeoutError(f"{self.description} did not complete within {limit:.1f}s")
            self._latch.release()  # open for every other waiter
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._finished

    def exception(self) -> BaseException | None:
        return self._error if self._finished else None

    def result(self) -> Any:
        self.wait()
        return self._value


def _lock_timeout(limit: float | None) -> float:
    """``limit`` as a lock's acquire timeout: -1 waits for good."""
    return -1 if limit is None else min(max(limit, 0.0), _thread.TIMEOUT_MAX)
