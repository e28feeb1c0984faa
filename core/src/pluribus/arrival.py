"""Who did not reach a collective: asked through the group's store after a timeout.

A rank whose collective times out says so under ``<key>/<its group rank>`` and waits a moment for
the other ranks that reached the same call (they time out at about the same time); a member
that never says so did not arrive (it is busy elsewhere or called something else). The store is
served by rank 0 or the launcher, which may be the process that is gone, so every store call on
this path runs on a helper thread with a bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: How long a rank waits for the others that reached the same collective to say so.
ARRIVAL_GRACE = 1.0
#: How long one store call on a failure path may take.
STORE_SECONDS = 1.0

_MISSING = object()


def ask_store(store, question: Callable[[Any], Any], limit: float = STORE_SECONDS) -> Any:
    """``question(store)`` on a helper thread, waiting at most ``limit`` seconds; raises
    TimeoutError when the store does not answer in time (the helper is left to finish)."""
    answer: list = []

    def ask() -> None:
        try:
            answer.append(question(store))
        except BaseException as exc:  # handed to the caller
            answer.append(exc)

    helper = threading.Thread(target=ask, name="pluribus-store-question", daemon=True)
    helper.start()
    helper.join(limit)
    if not answer:
        raise TimeoutError(f"the store did not answer within {limit:.0f}s")
    if isinstance(answer[0], BaseException):
        raise answer[0]
    return answer[0]


def absent_ranks(store, key: str, me: int, size: int, grace: float = ARRIVAL_GRACE) -> list[int]:
    """The group ranks that did not say they reached ``key`` within ``grace`` of this rank."""

    def ask(store) -> list[int]:
        store.set(f"{key}/{me}", "1")
        deadline = time.monotonic() + grace
        missing = None
        while True:
            try:
                missing = [r for r in range(size) if not store.check([f"{key}/{r}"])]
            except Exception:
                # The store's server went away during the grace: its rank had its answer and
                # ended (under mpiexec that ends the job). Every rank that arrived with it has
                # said so by now, so the last answer stands.
                if missing is None:
                    raise
                return missing
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.05)

    return ask_store(store, ask, grace + STORE_SECONDS)


def explain(missing: list[int] | None, timeout: float) -> str:
    """The end of a timeout message: who did not arrive (``None``: the store did not say)."""
    if missing is None:
        return "; the store did not answer, so which ranks did not arrive is unknown"
    if not missing:
        return "; every rank reached it, so a rank is stuck inside it"
    return (
        f"; rank(s) {missing} did not reach it within {timeout:.0f}s (they are busy elsewhere "
        "or called a different collective)"
    )
