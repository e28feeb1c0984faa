"""Setting up gloo's full mesh: the core's mesh (:func:`pluribus.tcp_mesh.connect_mesh`: one TCP
connection per pair of ranks, found through the store, both ends authenticated), then on each
fresh connection a hello (rank, host id, whether shared memory is on); two ranks on one host
then agree on a shared-memory segment over it.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
from dataclasses import dataclass

from pluribus import tcp_mesh
from pluribus.errors import PluribusError
from pluribus.store import recv_exact
from pluribus.tcp_mesh import IFNAME_ENV, listen_address  # noqa: F401  (gloo's settings, re-exported)

from . import shm

log = logging.getLogger("pluribus.gloo")

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
    """Connect this rank to every other rank of the group (the core's mesh), greet each peer
    and share memory with the ones on this host; return the connections by rank."""
    me = host_id()
    peers: dict[int, PeerConnection] = {}

    def greet(sock, peer: int) -> None:
        if peer < rank:  # this rank connected: it speaks first
            _send_hello(sock, rank, size, use_shm, me)
            peer_rank, peer_size, peer_shm, peer_host = _recv_hello(sock)
        else:
            peer_rank, peer_size, peer_shm, peer_host = _recv_hello(sock)
            _send_hello(sock, rank, size, use_shm, me)
        if peer_rank != peer or peer_size != size:
            raise PluribusError(
                f"rank {rank}: expected gloo rank {peer} of {size} but found rank {peer_rank} "
                f"of {peer_size}; are two jobs sharing a store?"
            )
        segment = None
        if use_shm and peer_shm and peer_host == me:
            share = _share_memory_as_joiner if peer < rank else _share_memory_as_creator
            segment = share(sock, shm_capacity)
        peers[peer] = PeerConnection(peer, sock, peer_host, segment)

    try:
        socks = tcp_mesh.connect_mesh(
            rank,
            size,
            store,
            timeout,
            "gloo connection",
            key="addr",
            address=tcp_mesh.listen_address(options),
            greet=greet,
            token=token,
        )
    except BaseException:
        for conn in peers.values():
            if conn.segment is not None:
                conn.segment.close()
        raise
    for sock in socks.values():
        _tune(sock)
    return peers


def platform_ok() -> tuple[bool, str]:
    if sys.platform.startswith("linux") or sys.platform == "darwin":
        return True, ""
    return False, f"the gloo backend needs a POSIX system (Linux or macOS), not {sys.platform}"
