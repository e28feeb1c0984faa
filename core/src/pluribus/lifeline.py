"""Lifelines: how every rank learns within milliseconds that another rank died or aborted.

One TCP connection per pair of ranks (:func:`pluribus.tcp_mesh.connect_mesh`), watched by one
thread per process and world. The kernel closes a dead process's sockets at once, so an end of
file without a goodbye means the peer died; a rank that aborts says why first (``A`` and the
reason), one that destroys its group says goodbye (``B``), so neither reads as a crash. The
first failure heard is the root cause every listener is told about; a rank that aborts because
of another's failure passes that root cause on instead of its own symptom.

The core opens lifelines for a world whose backend does not detect failures itself
(``Backend.detects_failures``); gloo and ucc keep their own, faster, detection.
:class:`WatchedStore` is the store the core hands each backend: a failure ends its waits, so
that a send/recv-only backend waiting on it can run its calls on the calling thread.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections.abc import Callable

from .errors import DistTimeoutError, PluribusError
from .store import PrefixStore, Store, _timeout_error
from .tcp_mesh import connect_mesh

_BYE, _ABORT = b"B", b"A"
DIED = "died: its process exited or was killed"
#: The longest line a lifeline carries (an abort reason is cut to 4000 bytes); a peer that
#: sends more without a line end is not speaking this protocol and counts as failed.
MAX_LINE = 8192
GARBLED = "failed: it sent a malformed lifeline message"


class Lifeline:
    """This rank's lifelines to every other rank of a world of ``size``.

    ``add_listener(fn)`` has ``fn(peer, reason)`` called (on the watching thread) for the first
    failure heard: ``reason`` reads after "rank <peer> ", e.g. "died: ..." or "aborted: ...".
    """

    def __init__(self, rank: int, size: int, store, timeout: float):
        self.rank = rank
        self.size = size
        self.failure: tuple[int, str] | None = None
        self._listeners: list[Callable[[int, str], None]] = []
        self._lock = threading.Lock()
        self._said_bye: set[int] = set()
        self._aborted = False
        self._closed = False
        self._socks = connect_mesh(rank, size, store, timeout, "lifeline", key="lifeline")
        self._wake_r, self._wake_w = os.pipe()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._inbox: dict[int, bytearray] = {}
        for peer, sock in self._socks.items():
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, peer)
        self._thread = threading.Thread(
            target=self._watch, name=f"pluribus-lifeline-{rank}", daemon=True
        )
        self._thread.start()

    def add_listener(self, listener: Callable[[int, str], None]) -> None:
        """Call ``listener(peer, reason)`` on the first failure (at once if one was heard)."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._listeners.append(listener)
        if failure is not None:
            listener(*failure)

    def remove_listener(self, listener: Callable[[int, str], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def abort(self, reason: str) -> None:
        """Tell every peer this rank aborts, with the root cause when a peer failed first."""
        with self._lock:
            if self._aborted or self._closed:
                return
            self._aborted = True
            if self.failure is not None:
                peer, why = self.failure
                reason = f"after rank {peer} {why}"
        self._tell(_ABORT + reason.replace("\n", " ").encode(errors="replace")[:4000] + b"\n")

    def close(self) -> None:
        """Say goodbye to every peer and stop watching."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._tell(_BYE + b"\n")
        os.write(self._wake_w, b"x")
        self._thread.join(5.0)
        for sock in self._socks.values():
            sock.close()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _tell(self, message: bytes) -> None:
        tell(self._socks.values(), message)

    def _watch(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select():
                if key.data is None:
                    return  # woken by close
                self._read(key.data, key.fileobj)

    def _read(self, peer: int, sock: socket.socket) -> None:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError as exc:
            data, died = b"", f"died: its lifeline failed ({exc})"
        else:
            died = DIED
        inbox = self._inbox.setdefault(peer, bytearray())
        inbox += data
        while b"\n" in inbox:
            line, _, rest = bytes(inbox).partition(b"\n")
            inbox[:] = rest
            if line.startswith(_ABORT):
                self._failed(peer, f"aborted: {line[1:].decode(errors='replace')}")
            elif line.startswith(_BYE):
                self._said_bye.add(peer)
        if len(inbox) > MAX_LINE:
            data, died = b"", GARBLED
        if data:
            return
        self._selector.unregister(sock)
        if peer not in self._said_bye:
            self._failed(peer, died)

    def _failed(self, peer: int, reason: str) -> None:
        with self._lock:
            if self.failure is not None or self._closed:
                return
            self.failure = (peer, reason)
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(peer, reason)
            except Exception:  # a listener's bug must not stop the others hearing
                pass


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts): what the sweeps of
    files a killed process left behind ask before they remove its files."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def tell(socks, message: bytes) -> None:
    """Send ``message`` on every lifeline that still takes it (a dead peer's does not), waiting
    at most a second on each; the sockets stay non-blocking for their watchers."""
    for sock in socks:
        try:
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall(message)
        except OSError:
            pass
        finally:
            try:
                sock.setblocking(False)
            except OSError:
                pass


class WatchedStore(PrefixStore):
    """The store (a prefixed view) the core gives a backend in ``BackendContext.store``:
    :meth:`abort`, which the core calls with the backend's ``abort`` after a failure, ends every
    wait on it within :attr:`SLICE` seconds, and makes every later ``get``, ``wait`` and
    ``check`` raise, with a PluribusError the core then replaces by the failure (the PeerError
    naming the failed rank)."""

    #: The longest a wait runs before it looks again whether the store was aborted.
    SLICE = 0.25

    def __init__(self, prefix: str, store: Store):
        super().__init__(prefix, store)
        self.aborted: str | None = None

    def abort(self, reason: str) -> None:
        self.aborted = reason

    def get(self, key, timeout=None):
        start = time.monotonic()
        deadline = start + self._timeout(timeout)
        while True:
            self._check()
            left = deadline - time.monotonic()
            try:
                return super().get(key, max(0.0, min(self.SLICE, left)))
            except DistTimeoutError:
                if left <= self.SLICE:
                    raise _timeout_error(self._k(key), time.monotonic() - start) from None

    def check(self, keys):
        self._check()  # a backend polling with check() is stopped too
        return super().check(keys)

    def wait(self, keys, timeout=None):
        deadline = time.monotonic() + self._timeout(timeout)
        for key in keys:
            self.get(key, max(0.0, deadline - time.monotonic()))

    def _check(self) -> None:
        if self.aborted is not None:
            raise PluribusError(f"store {self.prefix!r}: the group was stopped: {self.aborted}")
