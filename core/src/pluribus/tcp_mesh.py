"""Connecting every rank of a group to every other over TCP, through the group's store.

Each rank listens on one port and publishes ``host:port`` under ``<key>/<rank>``; it then
connects to every lower rank and accepts one connection from every higher rank, so no two ranks
wait on each other. Both ends answer the other's shared-secret challenge when
``PLURIBUS_AUTH_TOKEN`` is set. What each pair says next is the caller's: ``greet`` runs on
every fresh connection (the connecting side first sends its rank). Used by the core's lifelines,
gloo's data mesh and ucc's lifelines.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable

from .errors import AuthenticationError, DistTimeoutError, PeerError, PluribusError
from .store import AUTH_TOKEN_ENV, client_handshake, recv_exact, server_handshake

IFNAME_ENV = "PLURIBUS_SOCKET_IFNAME"
#: How long one incoming connection may take to authenticate and greet: connections are
#: handshaken concurrently, so a silent one costs only its own slot.
HANDSHAKE_SECONDS = float(os.environ.get("PLURIBUS_HANDSHAKE_SECONDS", 5.0))
log = logging.getLogger("pluribus.tcp_mesh")
_RANK = struct.Struct("!I")


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface ``ifname`` (Linux)."""
    import fcntl

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        request = struct.pack("256s", ifname.encode()[:15])
        reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
    except OSError as exc:
        raise PluribusError(
            f"{IFNAME_ENV}={ifname!r}: cannot read an IPv4 address of that interface ({exc}); "
            "list the interfaces with `ip -4 addr` and name one that has an address"
        ) from exc
    finally:
        probe.close()
    return socket.inet_ntoa(reply[20:24])


def listen_address(options: dict | None = None) -> str:
    """Where this rank listens: the interface named by ``PLURIBUS_SOCKET_IFNAME``, else the
    local address that reaches ``MASTER_ADDR``, else loopback."""
    options = options or {}
    ifname = options.get("ifname") or os.environ.get(IFNAME_ENV)
    if ifname:
        return interface_address(ifname)
    if options.get("listen_addr"):
        return str(options["listen_addr"])
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    try:
        master_ip = socket.gethostbyname(master)
    except OSError as exc:
        raise PluribusError(f"MASTER_ADDR={master!r} does not resolve: {exc}") from exc
    if ipaddress.ip_address(master_ip).is_loopback:
        return "127.0.0.1"
    # the address this host uses to reach the master (a UDP connect sends no packet)
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((master_ip, 9))
        return probe.getsockname()[0]
    except OSError:
        return master_ip
    finally:
        probe.close()


def connect_mesh(
    rank: int,
    size: int,
    store,
    timeout: float,
    what: str,
    key: str = "mesh",
    address: str | None = None,
    greet: Callable[[socket.socket, int], None] | None = None,
    token: str | None = None,
) -> dict[int, socket.socket]:
    """One connected socket to every other rank, by rank. ``what`` names the connections in
    errors ("lifeline", "gloo connection"); ``greet(sock, peer)`` runs on each new connection
    after the handshake, on both sides (the side with the higher rank connected). ``token``
    defaults to ``PLURIBUS_AUTH_TOKEN``."""
    token = token or os.environ.get(AUTH_TOKEN_ENV) or None
    deadline = time.monotonic() + timeout
    address = address or listen_address()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen(max(size, 8))
    except OSError as exc:
        listener.close()
        raise PluribusError(
            f"rank {rank}: cannot listen for {what}s on {address} ({exc}); set {IFNAME_ENV} to "
            "the interface the ranks reach each other through"
        ) from exc
    port = listener.getsockname()[1]
    store.set(f"{key}/{rank}", f"{address}:{port}")
    peers: dict[int, socket.socket] = {}
    try:
        for peer in range(rank):
            left = max(0.1, deadline - time.monotonic())
            host, _, peer_port = store.get(f"{key}/{peer}", left).decode().rpartition(":")
            where = f"rank {peer}'s {what} at {host}:{peer_port}"
            sock = _connect(host, int(peer_port), deadline, rank, where)
            try:
                sock.settimeout(max(1.0, deadline - time.monotonic()))
                client_handshake(sock, token, where)
                if not server_handshake(sock, token, f"rank {rank}'s {what}"):
                    raise AuthenticationError(
                        f"rank {rank}: {where} answered this rank's challenge with a wrong auth "
                        "token; every rank must have the same PLURIBUS_AUTH_TOKEN"
                    )
                sock.sendall(_RANK.pack(rank))
            except BaseException:
                sock.close()
                raise
            peers[peer] = _greeted(sock, peer, greet)
        _admit_all(listener, rank, size, token, what, deadline, timeout, greet, peers, address)
    except BaseException:
        for sock in peers.values():
            sock.close()
        raise
    finally:
        listener.close()
    return peers


def _admit_all(listener, rank, size, token, what, deadline, timeout, greet, peers, address):
    """Accept the higher ranks' connections until every one is in ``peers``.

    Each connection is authenticated and greeted on a thread of its own, within
    ``HANDSHAKE_SECONDS``: a connection that stays silent or fails the handshake is dropped
    without delaying the others (an idle connection to the port must not stall set-up).
    """
    results: queue.Queue = queue.Queue()
    pending: set[socket.socket] = set()
    claimed: set[int] = set()
    lock = threading.Lock()

    def admit(sock: socket.socket) -> None:
        per_connection = min(deadline, time.monotonic() + HANDSHAKE_SECONDS)
        peer = None
        try:
            peer = _accept(sock, rank, size, token, what, per_connection)
            if peer is not None:
                with lock:
                    if peer in claimed:
                        peer = None
                    else:
                        claimed.add(peer)
            if peer is None:
                sock.close()
                results.put(None)
                return
            sock.settimeout(max(0.1, per_connection - time.monotonic()))
            results.put((peer, _greeted(sock, peer, greet)))
        except (OSError, ConnectionError) as exc:
            log.info("rank %d: dropped a %s during its handshake (%s)", rank, what, exc)
            sock.close()
            if peer is not None:
                with lock:
                    claimed.discard(peer)
            results.put(None)
        except BaseException as exc:
            sock.close()
            results.put(exc)
        finally:
            with lock:
                pending.discard(sock)

    listener.settimeout(0.05)
    try:
        while len(peers) < size - 1:
            while True:
                try:
                    result = results.get_nowait()
                except queue.Empty:
                    break
                if isinstance(result, BaseException):
                    raise result
                if result is not None:
                    peers[result[0]] = result[1]
            if len(peers) == size - 1:
                break
            if deadline - time.monotonic() <= 0:
                missing = sorted(set(range(rank + 1, size)) - set(peers))
                raise DistTimeoutError(
                    f"rank {rank}: ranks {missing} did not open their {what} to this rank "
                    f"within {timeout:.0f}s; check that every rank started and can reach "
                    f"{address}:{listener.getsockname()[1]} (choose the interface with "
                    f"{IFNAME_ENV})"
                )
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            with lock:
                pending.add(sock)
            threading.Thread(
                target=admit, args=(sock,), name="pluribus-handshake", daemon=True
            ).start()
    finally:
        with lock:
            for sock in pending:  # wakes their threads at once
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if len(peers) < size - 1:  # failed: close what was admitted but not yet collected
            while not results.empty():
                result = results.get_nowait()
                if isinstance(result, tuple):
                    result[1].close()


def _greeted(sock: socket.socket, peer: int, greet) -> socket.socket:
    """``sock`` after the caller's greeting, blocking again; closed if the greeting fails."""
    try:
        if greet is not None:
            greet(sock, peer)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock


def _connect(host: str, port: int, deadline: float, rank: int, where: str) -> socket.socket:
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10.0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise PeerError(f"rank {rank}: cannot connect to {where}: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _accept(sock, rank, size, token, what, deadline) -> int | None:
    """Authenticate one incoming connection and read its rank; None when refused."""
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not server_handshake(sock, token, f"rank {rank}'s {what}"):
            return None
        client_handshake(sock, token, f"a peer of rank {rank}")
        (peer,) = _RANK.unpack(recv_exact(sock, _RANK.size, f"{what} during set-up"))
    except (OSError, ConnectionError, AuthenticationError, PluribusError, struct.error):
        return None
    if not rank < peer < size:
        return None
    return peer
