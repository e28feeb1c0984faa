"""Remote references: a handle to a value that lives on its owner, counted across workers.

The owner keeps each value in its ``OwnerTable`` with a count of the handles that exist
anywhere (its own included). A handle is created holding one count and gives it back with
``release()`` (or the end of a ``with`` block, or, as a fallback, when it is garbage
collected). When a handle travels in a message, the sender first adds a count for the handle
the receiver will make (a round trip to the owner, before the message leaves), so the value
cannot be freed in between even if the sender releases its own handle at once. One exception
saves that round trip: a request sent to the owner itself, which adds the count when it reads
the request, before it reads the sender's later release on the same connection.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import DistTimeoutError, PluribusError
from .pool import waiting

if TYPE_CHECKING:
    from .agent import Agent


class _Entry:
    """One owned value: pending until its creator finishes, then a value or an error."""

    __slots__ = ("count", "value", "error", "ready", "callbacks")

    def __init__(self, count: int):
        self.count = count
        self.value: Any = None
        self.error: tuple[str, str, str] | None = None  # type name, message, traceback
        self.ready = threading.Event()
        self.callbacks: list[Callable[[], None]] = []


class OwnerTable:
    """The values this worker owns, by id, with their counts."""

    def __init__(self, who: str):
        self.who = who
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def create(self, rid: str) -> None:
        """A pending value with one count (its creator's handle)."""
        with self._lock:
            if rid in self._entries:
                raise ValueError(f"RRef id {rid!r} exists already")
            self._entries[rid] = _Entry(1)

    def fulfil(self, rid: str, value: Any = None, exc: BaseException | None = None) -> None:
        """Set a pending value (or the exception that creating it raised)."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:  # every handle was released before it was made
                return
            if exc is not None:
                entry.error = (
                    type(exc).__qualname__,
                    str(exc),
                    "".join(traceback.format_exception(exc)),
                )
            else:
                entry.value = value
            entry.ready.set()
            callbacks, entry.callbacks = entry.callbacks, []
        for callback in callbacks:
            callback()

    def incref(self, rid: str) -> None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None or entry.count <= 0:
                raise LookupError(f"{self.who} owns no RRef {rid!r} (it was released)")
            entry.count += 1

    def decref(self, rid: str) -> None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                return
            entry.count -= 1
            if entry.count <= 0:
                del self._entries[rid]

    def when_ready(self, rid: str, callback: Callable[[_Entry], None]) -> None:
        """``callback(entry)`` once the value is set (at once if it is)."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                raise LookupError(f"{self.who} owns no RRef {rid!r} (it was released)")
            if not entry.ready.is_set():
                entry.callbacks.append(lambda: callback(entry))
                return
        callback(entry)

    def wait(self, rid: str, timeout: float) -> Any:
        """The value, waiting for it to be made; raises what making it raised."""
        with self._lock:
            entry = self._entries.get(rid)
        if entry is None:
            raise LookupError(f"{self.who} owns no RRef {rid!r} (it was released)")
        with waiting():
            if not entry.ready.wait(timeout):
                raise DistTimeoutError(
                    f"{self.who}: the value of RRef {rid} was not made within {timeout:.3g}s"
                )
        if entry.error is not None:
            kind, message, trace = entry.error
            raise PluribusError(
                f"{self.who}: making the value of RRef {rid} raised {kind}: {message}\n{trace}"
            )
        return entry.value

    def count(self, rid: str) -> int:
        """The handles of ``rid`` alive anywhere (0 once freed)."""
        with self._lock:
            entry = self._entries.get(rid)
            return 0 if entry is None else entry.count

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


class RRef:
    """A reference to a value on its owner worker.

    ``rpc.remote(...)`` makes one whose value lives on the callee; ``RRef(value)`` makes one
    owned here, to hand to other workers. Release it with ``release()`` or a ``with`` block.
    """

    def __init__(self, value: Any):
        from .api import current_agent

        agent = current_agent()
        rid = agent.new_rref_id()
        agent.table.create(rid)
        agent.table.fulfil(rid, value)
        self._bind(agent, agent.rank, rid, None)

    @classmethod
    def _handle(cls, agent: Agent, owner: int, rid: str, created=None) -> RRef:
        """A handle that already holds its count."""
        handle = cls.__new__(cls)
        handle._bind(agent, owner, rid, created)
        return handle

    def _bind(self, agent: Agent, owner: int, rid: str, created) -> None:
        self._agent = agent
        self._owner = owner
        self._id = rid
        self._created = created  # the future of remote()'s reply, on the creator
        self._released = False

    # -- who and where ---------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    def owner(self):
        """The owner's ``WorkerInfo``."""
        return self._agent.workers[self._owner]

    def owner_name(self) -> str:
        return self._agent.workers[self._owner].name

    def is_owner(self) -> bool:
        return self._owner == self._agent.rank

    # -- the value -------------------------------------------------------------------------

    def local_value(self, timeout: float | None = None) -> Any:
        """The value itself; only on the owner."""
        self._check_usable("local_value")
        if not self.is_owner():
            raise PluribusError(
                f"worker {self._agent.name!r}: local_value() of {self!r}, which worker "
                f"{self.owner_name()!r} owns; use to_here() to copy the value here"
            )
        return self._agent.table.wait(self._id, self._agent.timeout_of(timeout))

    def to_here(self, timeout: float | None = None) -> Any:
        """A copy of the value (the value itself on the owner)."""
        self._check_usable("to_here")
        if self.is_owner():
            return self.local_value(timeout)
        return self._agent.fetch(self, timeout)

    def confirmed(self, timeout: float | None = None) -> RRef:
        """Wait until the owner made the value; raises the RemoteError if making it failed."""
        self._check_usable("confirmed")
        if self._created is not None:
            self._created.result(self._agent.timeout_of(timeout))
        return self

    # -- calling methods of the value --------------------------------------------------------

    def rpc_sync(self, timeout: float | None = None) -> _Proxy:
        """``rref.rpc_sync().method(*args)``: call a method of the value on its owner, wait."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float | None = None) -> _Proxy:
        """``rref.rpc_async().method(*args)`` -> Future."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float | None = None) -> _Proxy:
        """``rref.remote().method(*args)`` -> RRef of the result, kept on the owner."""
        return _Proxy(self, "remote", timeout)

    # -- lifetime --------------------------------------------------------------------------

    def release(self) -> None:
        """Give this handle's count back; the owner frees the value when no handle is left.
        Using the handle afterwards is an error; releasing twice does nothing."""
        if self._released:
            return
        self._released = True
        self._agent.release(self._owner, self._id)

    def __enter__(self) -> RRef:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            self._released = True
            self._agent.release_later(self._owner, self._id)

    def _check_usable(self, what: str) -> None:
        if self._released:
            raise PluribusError(
                f"worker {self._agent.name!r}: {what}() of {self!r} after release(); keep the "
                "handle until you are done with it, or get a new one from its owner"
            )
        self._agent.check_running(what)

    def __repr__(self) -> str:
        state = ", released" if self._released else ""
        try:
            owner = self.owner_name()
        except Exception:
            owner = f"rank {self._owner}"
        return f"RRef({self._id} on {owner!r}{state})"

    def __reduce__(self):
        raise TypeError(
            "an RRef cannot be pickled; pass it as an RPC argument or result, which carries it "
            "with its reference count"
        )


class _Proxy:
    """``rref.rpc_sync()`` and friends: attribute access names the method to call."""

    def __init__(self, rref: RRef, mode: str, timeout: float | None):
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(f"only public methods can be called remotely, not {method!r}")

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._rref._agent.call_method(
                self._rref, method, args, kwargs, self._mode, self._timeout
            )

        call.__name__ = method
        return call
