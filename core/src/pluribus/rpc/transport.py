"""Authenticated connections between workers: the listener and the connecting side.

The handshake comes before any other byte is read, and the server parses nothing in it:

    server -> client   HELLO + server nonce (32 bytes)
    client -> server   HMAC(secret, "client" + server nonce + rank) + client nonce + rank
    server -> client   HMAC(secret, "server" + client nonce)      (only if the client's was right)

So each side proves it holds the job's secret without sending it, and a replayed answer is
useless (fresh nonces). The listener takes connections on its TCP port and, for workers of its
host, on a Unix socket in Linux's abstract namespace named after that port; both get the same
handshake. The listener runs every handshake on one thread with non-blocking
sockets and a deadline: random bytes, huge lengths or half-open sockets cost a socket and at
most 68 bytes each until they are dropped, never a thread, and at most ``MAX_PENDING`` of them
are kept (the oldest go first).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from ..errors import AuthenticationError, PeerError, PluribusError
from ..store import auth_digest
from ..tcp_mesh import IFNAME_ENV

log = logging.getLogger("pluribus.rpc")

HELLO = b"PLRBRPC1"
_NONCE = 32
_RANK = struct.Struct("<I")
_CLIENT_PROOF = 32 + _NONCE + _RANK.size
HANDSHAKE_TIMEOUT = 5.0
MAX_PENDING = 256


def _client_digest(secret: str, nonce: bytes, rank_bytes: bytes) -> bytes:
    return auth_digest(secret, b"client" + nonce + rank_bytes)


def _server_digest(secret: str, nonce: bytes) -> bytes:
    return auth_digest(secret, b"server" + nonce)


class _Pending:
    __slots__ = ("sock", "nonce", "received", "deadline")

    def __init__(self, sock: socket.socket, nonce: bytes):
        self.sock = sock
        self.nonce = nonce
        self.received = bytearray()
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT


class Listener:
    """Accepts connections on ``address`` and hands each authenticated one, with the peer's
    rank, to ``on_connection(sock, rank)`` (on the listener's thread; it must not block)."""

    def __init__(
        self,
        address: str,
        secret: str,
        world_size: int,
        on_connection: Callable[[socket.socket, int], None],
        who: str,
    ):
        self.secret = secret
        self.world_size = world_size
        self.on_connection = on_connection
        self.who = who
        self.refused = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((address, 0))
            self._sock.listen(128)
        except OSError as exc:
            self._sock.close()
            raise PluribusError(
                f"{who}: cannot listen for RPC connections on {address} ({exc}); set "
                f"{IFNAME_ENV} to the interface the workers reach each other through"
            ) from exc
        self._sock.setblocking(False)
        self.host, self.port = self._sock.getsockname()[:2]
        self._local = _listen_locally(self.host, self.port)
        #: whether it listens in the abstract Unix namespace too (see ``_local_name``)
        self.local = self._local is not None
        self._pending: dict[int, _Pending] = {}
        self._selector = selectors.DefaultSelector()
        for listening in (self._sock, self._local):
            if listening is not None:
                self._selector.register(listening, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"{who}-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(2.0)

    def _loop(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select(timeout=0.5):
                    if key.data == "wake":
                        break
                    try:
                        if key.data is None:
                            self._accept(key.fileobj)
                        else:
                            self._read(key.data)
                    except Exception as exc:  # one connection's trouble must not stop the rest
                        log.warning("%s: an RPC connection failed to open: %s", self.who, exc)
                        if isinstance(key.data, _Pending):
                            self._drop(key.data)
                self._expire()
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()
            self._sock.close()
            if self._local is not None:
                self._local.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _accept(self, listening: socket.socket) -> None:
        while True:
            try:
                sock, _ = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: refuse until some close
                log.warning("%s: cannot accept an RPC connection: %s", self.who, exc)
                return
            if len(self._pending) >= MAX_PENDING:
                self._drop(min(self._pending.values(), key=lambda p: p.deadline))
            nonce = secrets.token_bytes(_NONCE)
            try:
                sock.setblocking(False)
                if sock.family != _LOCAL:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if sock.send(HELLO + nonce) != len(HELLO) + _NONCE:
                    raise OSError("short write")
            except OSError:
                sock.close()
                continue
            pending = _Pending(sock, nonce)
            self._pending[sock.fileno()] = pending
            self._selector.register(sock, selectors.EVENT_READ, pending)

    def _read(self, pending: _Pending) -> None:
        try:
            data = pending.sock.recv(_CLIENT_PROOF - len(pending.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(pending)
            return
        pending.received += data
        if len(pending.received) < _CLIENT_PROOF:
            return
        proof = bytes(pending.received)
        digest, client_nonce, rank_bytes = proof[:32], proof[32:64], proof[64:]
        if not hmac.compare_digest(digest, _client_digest(self.secret, pending.nonce, rank_bytes)):
            self._refuse(pending, "a wrong secret")
            return
        (rank,) = _RANK.unpack(rank_bytes)  # authenticated bytes only
        if rank >= self.world_size:
            self._refuse(pending, f"rank {rank} outside the world")
            return
        sock = pending.sock
        self._forget(pending)
        try:
            sock.setblocking(True)
            sock.sendall(_server_digest(self.secret, client_nonce))
        except OSError:
            sock.close()
            return
        self.on_connection(sock, rank)

    def _refuse(self, pending: _Pending, why: str) -> None:
        self.refused += 1
        try:
            peer = pending.sock.getpeername() or "a local socket"
        except OSError:
            peer = "?"
        quiet = self.refused > 10 and str(self.refused).strip("0") != "1"  # 1-10, 100, 1000...
        log.log(
            logging.DEBUG if quiet else logging.WARNING,
            "%s: refused an RPC connection from %s: %s (%d refused so far)",
            self.who,
            peer,
            why,
            self.refused,
        )
        self._drop(pending)

    def _expire(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self._pending.values() if p.deadline < now]:
            self._drop(pending)

    def _forget(self, pending: _Pending) -> None:
        self._pending.pop(pending.sock.fileno(), None)
        try:
            self._selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, pending: _Pending) -> None:
        self._forget(pending)
        pending.sock.close()

    @property
    def pending(self) -> int:
        """Connections that have not finished the handshake (for tests)."""
        return len(self._pending)


_LOCAL = getattr(socket, "AF_UNIX", None)


def _local_name(host: str, port: int) -> str:
    """The listener's name in Linux's abstract Unix namespace (no file; gone with the socket):
    made from its TCP address, which no other live listener in this network namespace has."""
    return f"\0pluribus-rpc-{host}:{port}"


def _listen_locally(host: str, port: int) -> socket.socket | None:
    """A listening socket for workers of this host, where a small call's round trip costs the
    kernel a third less than TCP loopback; None where there is none (or the name is taken: the
    workers then use TCP)."""
    if _LOCAL is None or not os.path.exists("/proc/net/unix"):
        return None
    sock = socket.socket(_LOCAL, socket.SOCK_STREAM)
    try:
        sock.bind(_local_name(host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        return None
    return sock


def _open(host: str, port: int, local: bool, timeout: float) -> socket.socket:
    """A connected socket: through the listener's local name when it has one and this worker
    shares its host's network namespace, else by TCP."""
    if local and _LOCAL is not None:
        sock = socket.socket(_LOCAL, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(_local_name(host, port))
            return sock
        except OSError:  # another host, or another network namespace: TCP
            sock.close()
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect(
    host: str,
    port: int,
    secret: str,
    rank: int,
    timeout: float,
    where: str,
    local: bool = False,
):
    """A connected, authenticated socket to ``where`` (through its listener's local name when
    it has one, ``local``, and it can be reached there); PeerError when it cannot be reached,
    AuthenticationError when the secrets differ."""
    try:
        sock = _open(host, port, local, min(timeout, 10.0))
    except OSError as exc:
        raise PeerError(f"cannot connect to {where} at {host}:{port}: {exc}") from exc
    try:
        hello = _recv_exact(sock, len(HELLO) + _NONCE, where)
        if hello[: len(HELLO)] != HELLO:
            raise PluribusError(f"{where} at {host}:{port} is not a pluribus RPC worker")
        client_nonce = secrets.token_bytes(_NONCE)
        rank_bytes = _RANK.pack(rank)
        nonce = hello[len(HELLO) :]
        sock.sendall(_client_digest(secret, nonce, rank_bytes) + client_nonce + rank_bytes)
        try:
            answer = _recv_exact(sock, 32, where)
        except ConnectionError:
            raise AuthenticationError(
                f"{where} refused this worker's secret: every worker must have the same "
                "PLURIBUS_AUTH_TOKEN (pluribus-run sets one per job)"
            ) from None
        if not hmac.compare_digest(answer, _server_digest(secret, client_nonce)):
            raise AuthenticationError(
                f"{where} at {host}:{port} does not know the job's secret; it is not one of "
                "this job's workers"
            )
        sock.settimeout(None)
        return sock
    except PluribusError:
        sock.close()
        raise
    except OSError as exc:
        sock.close()
        raise PeerError(f"{where}: the RPC handshake failed ({exc})") from exc
    except BaseException:
        sock.close()
        raise


def _recv_exact(sock: socket.socket, size: int, where: str) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        try:
            chunk = sock.recv(size - len(buf))
        except OSError as exc:
            raise ConnectionError(f"{where}: {exc}") from exc
        if not chunk:
            raise ConnectionError(f"{where} closed the connection during the handshake")
        buf += chunk
    return bytes(buf)
