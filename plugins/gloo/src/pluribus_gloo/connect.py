"""Setting up the full mesh: one TCP connection per pair of ranks, found through the store.

Every rank listens on one port and publishes ``host:port`` in the group's store; each rank then
connects to every lower rank and accepts one connection from every higher rank. Both ends of a
connection answer the other's shared-secret challenge when ``PLURIBUS_AUTH_TOKEN`` is set, then
exchange a hello (rank, host id, whether shared memory is on). Two ranks on one host then agree
on a shared-memory segment over the fresh connection.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass

from pluribus.errors import AuthenticationError, DistTimeoutError, PeerError, PluribusError
from pluribus.store import client_handshake, recv_exact, server_handshake

from . import shm

log = logging.getLogger("pluribus.gloo")

IFNAME_ENV = "PLURIBUS_SOCKET_IFNAME"
_HELLO = struct.Struct("<4sIIBH")
_HELLO_MAGIC = b"PLGL"


#: What recv_exact names when a peer hangs up while connections are being made.
_SETUP = "peer connection during set-up"


def host_id() -> str:
    """Identifies this machine (and boot), so that ranks can tell who shares memory with whom."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


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


def listen_address(options: dict) -> str:
    """Where this rank listens: the interface named by ``PLURIBUS_SOCKET_IFNAME``, else the
    local address that reaches ``MASTER_ADDR``, else loopback."""
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


@dataclass
class PeerConnection:
    rank: int
    sock: socket.socket
    host: str
    segment: object = None  # an mmap when the pair shares memory


def _send_hello(sock: socket.socket, rank: int, size: int, use_shm: bool, host: str) -> None:
    data = host.encode()
    sock.sendall(_HELLO.pack(_HELLO_MAGIC, rank, size, 1 if use_shm else 0, len(data)) + data)


def _recv_hello(sock: socket.socket) -> tuple[int, int, bool, str]:
    magic, rank, size, use_shm, n = _HELLO.unpack(recv_exact(sock, _HELLO.size, _SETUP))
    if magic != _HELLO_MAGIC:
        raise ConnectionError("not a pluribus gloo peer (bad hello)")
    return rank, size, bool(use_shm), recv_exact(sock, n, _SETUP).decode()


#: Socket buffer size for data connections (0 keeps the kernel's autotuning).
SOCKET_BUFFER = int(os.environ.get("PLURIBUS_GLOO_SOCKET_BUFFER", 0))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
            except OSError:
                pass


def _share_memory_as_creator(sock: socket.socket, capacity: int):
    """Create the pair's segment, hand its name over, unlink it once the peer has it mapped."""
    try:
        name, segment = shm.create_segment(capacity)
    except OSError as exc:
        log.info("gloo: cannot create shared memory (%s); using the socket", exc)
        sock.sendall(struct.pack("<H", 0))
        return None
    try:
        data = name.encode()
        sock.sendall(struct.pack("<H", len(data)) + data)
        ok = recv_exact(sock, 1, _SETUP) == b"\x01"
    except BaseException:
        segment.close()
        raise
    finally:
        shm.unlink(name)
    if not ok:
        segment.close()
        return None
    return segment


def _share_memory_as_joiner(sock: socket.socket, capacity: int):
    (n,) = struct.unpack("<H", recv_exact(sock, 2, _SETUP))
    if n == 0:
        return None
    name = recv_exact(sock, n, _SETUP).decode()
    try:
        segment = shm.open_segment(name, capacity)
        shm.unlink(name)  # both sides unlink: whichever runs first removes the name
    except OSError as exc:
        log.info("gloo: cannot map the peer's shared memory %s (%s); using its socket", name, exc)
        sock.sendall(b"\x00")
        return None
    sock.sendall(b"\x01")
    return segment


def connect_mesh(
    rank: int,
    size: int,
    store,
    timeout: float,
    token: str | None,
    use_shm: bool,
    shm_capacity: int,
    options: dict,
) -> dict[int, PeerConnection]:
    """Connect this rank to every other rank of the group; return the connections by rank."""
    deadline = time.monotonic() + timeout
    me = host_id()
    address = listen_address(options)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
    except OSError as exc:
        listener.close()
        raise PluribusError(
            f"rank {rank}: gloo cannot listen on {address} ({exc}); set {IFNAME_ENV} to the "
            "interface the ranks reach each other through"
        ) from exc
    listener.listen(max(size, 8))
    port = listener.getsockname()[1]
    store.set(f"addr/{rank}", f"{address}:{port}")
    peers: dict[int, PeerConnection] = {}
    try:
        for peer in range(rank):
            remaining = max(0.1, deadline - time.monotonic())
            host, _, peer_port = store.get(f"addr/{peer}", remaining).decode().rpartition(":")
            where = f"gloo rank {peer} at {host}:{peer_port}"
            sock = _connect(host, int(peer_port), deadline, rank, where)
            try:
                sock.settimeout(max(1.0, deadline - time.monotonic()))
                client_handshake(sock, token, where)
                if not server_handshake(sock, token, f"gloo rank {rank}"):
                    raise AuthenticationError(
                        f"rank {rank}: {where} answered this rank's challenge with a wrong auth "
                        "token; every rank must have the same PLURIBUS_AUTH_TOKEN"
                    )
                _send_hello(sock, rank, size, use_shm, me)
                peer_rank, peer_size, peer_shm, peer_host = _recv_hello(sock)
                if peer_rank != peer or peer_size != size:
                    raise PluribusError(
                        f"rank {rank}: expected gloo rank {peer} of {size} at {host}:{peer_port} "
                        f"but found rank {peer_rank} of {peer_size}; are two jobs sharing a store?"
                    )
                segment = None
                if use_shm and peer_shm and peer_host == me:
                    segment = _share_memory_as_joiner(sock, shm_capacity)
                sock.settimeout(None)
            except BaseException:
                sock.close()
                raise
            peers[peer] = PeerConnection(peer, sock, peer_host, segment)
        while len(peers) < size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(rank + 1, size)) - set(peers))
                raise DistTimeoutError(
                    f"rank {rank}: gloo ranks {missing} did not connect within {timeout:.0f}s; "
                    "check that every rank started and can reach this host "
                    f"({address}:{port}, choose the interface with {IFNAME_ENV})"
                )
            listener.settimeout(min(remaining, 1.0))
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            accepted = _accept_one(sock, rank, size, token, use_shm, me, shm_capacity, deadline)
            if accepted is not None:
                peers[accepted.rank] = accepted
    except BaseException:
        for conn in peers.values():
            conn.sock.close()
            if conn.segment is not None:
                conn.segment.close()
        raise
    finally:
        listener.close()
    for conn in peers.values():
        _tune(conn.sock)
    return peers


def _connect(host: str, port: int, deadline: float, rank: int, where: str) -> socket.socket:
    delay = 0.01
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10.0)
            _tune(sock)
            return sock
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise PeerError(f"rank {rank}: cannot connect to {where}: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _accept_one(sock, rank, size, token, use_shm, me, capacity, deadline):
    """Authenticate and greet one incoming connection; None (and a log line) when refused."""
    try:
        sock.settimeout(max(1.0, min(10.0, deadline - time.monotonic())))
        if not server_handshake(sock, token, f"gloo rank {rank}"):
            sock.close()
            return None
        client_handshake(sock, token, f"a peer of gloo rank {rank}")
        peer_rank, peer_size, peer_shm, peer_host = _recv_hello(sock)
        if not (rank < peer_rank < size) or peer_size != size:
            log.warning(
                "gloo rank %d: refused a connection claiming to be rank %d of %d",
                rank,
                peer_rank,
                peer_size,
            )
            sock.close()
            return None
        _send_hello(sock, rank, size, use_shm, me)
        segment = None
        if use_shm and peer_shm and peer_host == me:
            segment = _share_memory_as_creator(sock, capacity)
        sock.settimeout(None)
        return PeerConnection(peer_rank, sock, peer_host, segment)
    except (OSError, ConnectionError, struct.error, AuthenticationError, PluribusError) as exc:
        log.warning("gloo rank %d: dropped a connection during set-up: %s", rank, exc)
        sock.close()
        return None


def platform_ok() -> tuple[bool, str]:
    if sys.platform.startswith("linux") or sys.platform == "darwin":
        return True, ""
    return False, f"the gloo backend needs a POSIX system (Linux or macOS), not {sys.platform}"
