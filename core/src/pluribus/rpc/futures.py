"""The future ``rpc_async`` returns (torch.futures.Future's names on concurrent.futures)."""

from __future__ import annotations

import concurrent.futures
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
