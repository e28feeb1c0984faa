"""The future ``rpc_async`` returns (torch.futures.Future's names on concurrent.futures), and
the lighter slot a waiting caller's reply lands in."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from .pool import waiting


class Future(concurrent.futures.Future):
    """A call's result to come. ``wait()`` returns it or raises the call's error; waiting inside
    a handler lets the worker's pool run other handlers meanwhile."""

    def result(self, timeout: float | None = None) -> Any:
        if self.done():
            return super().result(0)
        with waiting():
            return super().result(timeout)

    def wait(self, timeout: float | None = None) -> Any:
        """The result (torch's name); raises the remote error, a timeout or a dead worker."""
        return self.result(timeout)

    def value(self) -> Any:
        """The result of a finished future."""
        if not self.done():
            raise RuntimeError("value() of a future that has not finished; use wait()")
        return super().result(0)

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """A future of ``callback(self)``, run when this one finishes."""
        chained = Future()

        def run(done: concurrent.futures.Future) -> None:
            try:
                chained.set_result(callback(done))
            except BaseException as exc:
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained


class Reply:
    """Where the reply of a call its caller waits for (``rpc_sync``, ``to_here()``) lands: the
    part of a Future a channel uses (``done``, ``set_result``, ``set_exception``) without its
    condition variable and callbacks, which cost a small call as much as its JSON. Settled
    once, by whichever thread reads the reply (or fails the connection)."""

    __slots__ = ("_done", "_value", "_error", "_settled")

    def __init__(self):
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._settled = threading.Lock()
        self._settled.acquire()  # released when settled

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._value = value
        self._done = True
        self._settled.release()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._done = True
        self._settled.release()

    def wait(self, timeout: float) -> bool:
        """Whether it is settled, waiting up to ``timeout`` seconds (any thread may wait)."""
        if self._done:
            return True
        if self._settled.acquire(timeout=max(0.0, timeout)):
            self._settled.release()
        return self._done

    def result(self) -> Any:
        """The value of a settled reply, or its error raised."""
        if self._error is not None:
            raise self._error
        return self._value
