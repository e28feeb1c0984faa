"""Key-value stores the ranks rendezvous through (torch.distributed's Store API).

``TCPStore`` is served by rank 0 (or the launcher) and reached by every rank; ``HashStore`` lives
in one process (the ``threads`` backend and tests); ``FileStore`` works through a shared
directory; ``PrefixStore`` gives each group or backend a namespace of its own. Every blocking call
has a timeout and raises :class:`DistTimeoutError` naming the keys and the time waited.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

from .errors import AuthenticationError, DistTimeoutError, PluribusError

log = logging.getLogger("pluribus.store")

DEFAULT_TIMEOUT = 300.0
AUTH_TOKEN_ENV = "PLURIBUS_AUTH_TOKEN"


def _as_bytes(value: bytes | str | int) -> bytes:
    if isinstance(value, bytes):
        return value
    return str(value).encode()


class Store:
    """The interface every store implements. Values are bytes; ``add`` keeps an integer."""

    timeout: float = DEFAULT_TIMEOUT

    def set(self, key: str, value: bytes | str) -> None:
        raise NotImplementedError

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting for it to be set."""
        raise NotImplementedError

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 when missing) and return the new value."""
        raise NotImplementedError

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is missing and ``expected`` is
        empty); return the value it holds afterwards."""
        raise NotImplementedError

    def delete(self, key: str) -> bool:
        raise NotImplementedError

    def check(self, keys: list[str]) -> bool:
        """True when every key is set, without waiting."""
        raise NotImplementedError

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Block until every key is set."""
        deadline = time.monotonic() + self._timeout(timeout)
        for key in keys:
            self.get(key, max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        pass

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout


def _timeout_error(keys: list[str] | str, waited: float) -> DistTimeoutError:
    names = keys if isinstance(keys, str) else ", ".join(keys)
    return DistTimeoutError(
        f"store: key(s) {names!r} not set after {waited:.1f}s; a rank may not have reached this "
        "point (check that every rank runs the same code and that none has died)"
    )


class HashStore(Store):
    """An in-memory store shared by the threads of one process."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        self.timeout = timeout
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes | str) -> None:
        with self._cond:
            self._data[key] = _as_bytes(value)
            self._cond.notify_all()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        limit = self._timeout(timeout)
        start = time.monotonic()
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data, limit):
                raise _timeout_error(key, time.monotonic() - start)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._cond.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        with self._cond:
            current = self._data.get(key)
            if (current is None and _as_bytes(expected) == b"") or current == _as_bytes(expected):
                self._data[key] = _as_bytes(desired)
                self._cond.notify_all()
            return self._data.get(key, b"")

    def delete(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)


class PrefixStore(Store):
    """A view of another store in which every key is prefixed with ``prefix/``."""

    def __init__(self, prefix: str, store: Store):
        self.prefix = prefix
        self.store = store
        self.timeout = store.timeout

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key, value):
        self.store.set(self._k(key), value)

    def get(self, key, timeout=None):
        return self.store.get(self._k(key), timeout)

    def add(self, key, amount):
        return self.store.add(self._k(key), amount)

    def compare_set(self, key, expected, desired):
        return self.store.compare_set(self._k(key), expected, desired)

    def delete(self, key):
        return self.store.delete(self._k(key))

    def check(self, keys):
        return self.store.check([self._k(k) for k in keys])

    def wait(self, keys, timeout=None):
        self.store.wait([self._k(k) for k in keys], timeout)


class FileStore(Store):
    """A store in a directory that every rank can reach (``init_method="file:///path"``).

    Each key is a file written atomically (write then rename); ``add`` and ``compare_set`` hold
    an ``fcntl`` lock on the directory's lock file.
    """

    def __init__(self, path: str | os.PathLike, timeout: float = DEFAULT_TIMEOUT):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self._lockfile = self.path / ".lock"

    def _file(self, key: str) -> Path:
        return self.path / key.encode().hex()

    def _write(self, key: str, value: bytes) -> None:
        tmp = self.path / f".tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
        tmp.write_bytes(value)
        os.replace(tmp, self._file(key))

    def _locked(self):
        import fcntl

        handle = open(self._lockfile, "a+")
        fcntl.flock(handle, fcntl.LOCK_EX)
        return handle

    def set(self, key, value):
        self._write(key, _as_bytes(value))

    def get(self, key, timeout=None):
        limit = self._timeout(timeout)
        start = time.monotonic()
        delay = 0.001
        while True:
            try:
                return self._file(key).read_bytes()
            except FileNotFoundError:
                if time.monotonic() - start > limit:
                    raise _timeout_error(key, time.monotonic() - start) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def add(self, key, amount):
        with self._locked():
            try:
                value = int(self._file(key).read_bytes()) + amount
            except FileNotFoundError:
                value = amount
            self._write(key, str(value).encode())
            return value

    def compare_set(self, key, expected, desired):
        with self._locked():
            try:
                current = self._file(key).read_bytes()
            except FileNotFoundError:
                current = None
            if (current is None and _as_bytes(expected) == b"") or current == _as_bytes(expected):
                self._write(key, _as_bytes(desired))
                return _as_bytes(desired)
            return current or b""

    def delete(self, key):
        try:
            self._file(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def check(self, keys):
        return all(self._file(k).exists() for k in keys)


# -- TCP store -----------------------------------------------------------------------------------

_SET, _GET, _ADD, _CAS, _DELETE, _CHECK, _PING = range(1, 8)
_OK, _TIMEOUT, _MISSING = 0, 1, 2
_HELLO = b"PLRBSTR1"


#: The most fields one store command may carry (``check`` sends one per key).
MAX_FIELDS = 4096
#: The largest key or value the store server accepts; a longer field announced by a client is
#: refused before any of it is read.
MAX_FIELD_BYTES = int(os.environ.get("PLURIBUS_STORE_MAX_VALUE_BYTES", 64 << 20))
#: Bytes are read in pieces of at most this size, so what a peer announces costs memory only as
#: it actually arrives.
_READ_PIECE = 1 << 20


def recv_exact(sock: socket.socket, n: int, what: str = "store connection") -> bytes:
    """Exactly ``n`` bytes from ``sock``; ConnectionError when the other side closes first.

    Memory grows with the bytes received, not with ``n``: a peer that announces a large length
    and sends nothing costs nothing.
    """
    buf = bytearray(min(n, _READ_PIECE))
    got = 0
    while got < n:
        if got == len(buf):
            buf.extend(bytes(min(n - got, len(buf))))
        k = sock.recv_into(memoryview(buf)[got:])
        if k == 0:
            raise ConnectionError(f"{what} closed by the other side")
        got += k
    return bytes(buf)


class ProtocolError(ConnectionError):
    """A peer sent something this protocol never sends (a length beyond the limits)."""


def _send_fields(sock: socket.socket, op: int, *fields: bytes) -> None:
    parts = [struct.pack("!BI", op, len(fields))]
    for f in fields:
        parts.append(struct.pack("!Q", len(f)))
        parts.append(f)
    sock.sendall(b"".join(parts))


def _recv_fields(sock: socket.socket) -> tuple[int, list[bytes]]:
    op, count = struct.unpack("!BI", recv_exact(sock, 5))
    if count > MAX_FIELDS:
        raise ProtocolError(f"a store command with {count} fields (at most {MAX_FIELDS})")
    fields = []
    for _ in range(count):
        (n,) = struct.unpack("!Q", recv_exact(sock, 8))
        if n > MAX_FIELD_BYTES:
            raise ProtocolError(
                f"a store field of {n} bytes (at most {MAX_FIELD_BYTES}; raise "
                "PLURIBUS_STORE_MAX_VALUE_BYTES on the server for larger values)"
            )
        fields.append(recv_exact(sock, n))
    return op, fields


def auth_digest(token: str, nonce: bytes) -> bytes:
    """The shared-secret answer to a challenge: HMAC-SHA256(token, nonce)."""
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


def server_handshake(conn: socket.socket, token: str | None, what: str = "store") -> bool:
    """Challenge a freshly accepted connection; False (and a log line) when it fails."""
    nonce = secrets.token_bytes(32) if token else b""
    conn.sendall(_HELLO + struct.pack("!B", 1 if token else 0) + nonce)
    if not token:
        return True
    try:
        answer = recv_exact(conn, 32)
    except (OSError, ConnectionError):
        answer = b""
    if hmac.compare_digest(answer, auth_digest(token, nonce)):
        conn.sendall(b"\x01")
        return True
    try:
        peer = conn.getpeername()
    except OSError:
        peer = "?"
    log.warning("%s: refused a connection from %s: wrong or missing auth token", what, peer)
    try:
        conn.sendall(b"\x00")
    except OSError:
        pass
    return False


def client_handshake(sock: socket.socket, token: str | None, where: str) -> None:
    """Answer the server's challenge; raise :class:`AuthenticationError` when refused."""
    hello = recv_exact(sock, len(_HELLO) + 1)
    if hello[: len(_HELLO)] != _HELLO:
        raise PluribusError(f"{where} is not a pluribus endpoint (bad greeting)")
    if not hello[-1]:
        return
    nonce = recv_exact(sock, 32)
    if not token:
        raise AuthenticationError(
            f"{where} requires a shared secret: set {AUTH_TOKEN_ENV} to the job's token "
            "(pluribus-run sets it for its ranks)"
        )
    sock.sendall(auth_digest(token, nonce))
    try:
        verdict = recv_exact(sock, 1)
    except ConnectionError:
        verdict = b"\x00"
    if verdict != b"\x01":
        raise AuthenticationError(f"{where} refused this rank's auth token ({AUTH_TOKEN_ENV})")


class _TCPStoreServer:
    """The server side: one thread per client, waits served with a condition variable."""

    def __init__(self, host: str, port: int, token: str | None):
        self.data = HashStore()
        self.token = token
        self.listener = socket.create_server((host, port), reuse_port=False, backlog=512)
        self.port = self.listener.getsockname()[1]
        self._closed = False
        self._clients: set[socket.socket] = set()
        self._thread = threading.Thread(
            target=self._accept_loop, name="pluribus-store", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(10.0)
            if not server_handshake(conn, self.token):
                return
            conn.settimeout(None)
            self._clients.add(conn)
            while True:
                op, f = _recv_fields(conn)
                self._handle(conn, op, f)
        except ProtocolError as exc:
            log.warning("store: dropped a client that sent %s", exc)
        except (OSError, ConnectionError, struct.error):
            pass
        finally:
            self._clients.discard(conn)
            conn.close()

    def _handle(self, conn: socket.socket, op: int, f: list[bytes]) -> None:
        d = self.data
        if op == _SET:
            d.set(f[0].decode(), f[1])
            _send_fields(conn, _OK)
        elif op == _GET:
            timeout = struct.unpack("!d", f[1])[0]
            try:
                _send_fields(conn, _OK, d.get(f[0].decode(), timeout))
            except DistTimeoutError:
                _send_fields(conn, _TIMEOUT)
        elif op == _ADD:
            value = d.add(f[0].decode(), int(f[1]))
            _send_fields(conn, _OK, str(value).encode())
        elif op == _CAS:
            _send_fields(conn, _OK, d.compare_set(f[0].decode(), f[1], f[2]))
        elif op == _DELETE:
            _send_fields(conn, _OK, b"1" if d.delete(f[0].decode()) else b"0")
        elif op == _CHECK:
            _send_fields(conn, _OK, b"1" if d.check([k.decode() for k in f]) else b"0")
        elif op == _PING:
            _send_fields(conn, _OK)

    def close(self) -> None:
        self._closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for conn in list(self._clients):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class TCPStore(Store):
    """A store served over TCP. ``is_master=True`` starts the server in this process.

    ``port=0`` picks a free port (read it back from ``.port``). The server binds ``host`` (loopback
    by default). With ``auth_token`` (default: ``$PLURIBUS_AUTH_TOKEN``) every client must answer
    an HMAC challenge before any command is served; a refused client is logged and disconnected
    without disturbing the others.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        is_master: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        auth_token: str | None = None,
        wait_for_server: bool = True,
    ):
        self.host = host
        self.timeout = timeout
        self.auth_token = auth_token if auth_token is not None else os.environ.get(AUTH_TOKEN_ENV)
        self._server = _TCPStoreServer(host, port, self.auth_token) if is_master else None
        self.port = self._server.port if self._server else port
        # One connection per thread: a waiting get() must not block another thread's set().
        self._local = threading.local()
        self._sockets: list[socket.socket] = []
        self._sockets_lock = threading.Lock()
        self._local.sock = self._connect(timeout if wait_for_server else 0.0)

    def _connect(self, timeout: float) -> socket.socket:
        where = f"store at {self.host}:{self.port}"
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=10.0)
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise DistTimeoutError(
                        f"could not reach the {where} within {timeout:.0f}s ({exc}); is rank 0 "
                        "running and are MASTER_ADDR/MASTER_PORT the same on every rank?"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            client_handshake(sock, self.auth_token, where)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        with self._sockets_lock:
            self._sockets.append(sock)
        return sock

    def _call(self, op: int, *fields: bytes, wait: float = 0.0) -> list[bytes]:
        for field in fields:
            if len(field) > MAX_FIELD_BYTES:
                raise ValueError(
                    f"a store key or value of {len(field)} bytes is larger than the store takes "
                    f"({MAX_FIELD_BYTES}); store large data elsewhere, or raise "
                    "PLURIBUS_STORE_MAX_VALUE_BYTES on every process"
                )
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._local.sock = self._connect(self.timeout)
        sock.settimeout(wait + 30.0)
        try:
            _send_fields(sock, op, *fields)
            status, reply = _recv_fields(sock)
        except (OSError, ConnectionError) as exc:
            self._local.sock = None
            sock.close()
            raise PluribusError(
                f"lost the connection to the store at {self.host}:{self.port} ({exc}); "
                "the rank that serves it (rank 0 or the launcher) has probably exited"
            ) from exc
        if status == _TIMEOUT:
            raise DistTimeoutError("timeout")
        return reply

    def set(self, key, value):
        self._call(_SET, key.encode(), _as_bytes(value))

    def get(self, key, timeout=None):
        limit = self._timeout(timeout)
        start = time.monotonic()
        try:
            return self._call(_GET, key.encode(), struct.pack("!d", limit), wait=limit)[0]
        except DistTimeoutError:
            raise _timeout_error(key, time.monotonic() - start) from None

    def add(self, key, amount):
        return int(self._call(_ADD, key.encode(), str(int(amount)).encode())[0])

    def compare_set(self, key, expected, desired):
        return self._call(_CAS, key.encode(), _as_bytes(expected), _as_bytes(desired))[0]

    def delete(self, key):
        return self._call(_DELETE, key.encode())[0] == b"1"

    def check(self, keys):
        return self._call(_CHECK, *[k.encode() for k in keys])[0] == b"1"

    def close(self) -> None:
        try:
            with self._sockets_lock:
                for sock in self._sockets:
                    sock.close()
                self._sockets.clear()
        finally:
            if self._server is not None:
                self._server.close()
