"""Set-up is no denial-of-service target: idle or hostile connections to a rank's listener
cost at most their own handshake slot, never the job's set-up.

Gloo's data mesh and ucc's lifelines are both :func:`pluribus.tcp_mesh.connect_mesh`; these tests
run it on threads of one process, with hostile connections opened to rank 0 before any real peer
connects.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
from pluribus.store import HashStore
from pluribus.tcp_mesh import connect_mesh

WORLD = 4


def _mesh_with_hostile_connections(token, hostile_bytes: list[bytes]):
    store = HashStore()
    results: dict[int, dict] = {}
    errors: list[BaseException] = []
    hostile: list[socket.socket] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = connect_mesh(rank, WORLD, store, 20.0, "test link", token=token)
        except BaseException as exc:
            errors.append(exc)

    zero = threading.Thread(target=rank_main, args=(0,))
    zero.start()
    host, _, port = store.get("mesh/0", 10).decode().rpartition(":")
    for data in hostile_bytes:
        sock = socket.create_connection((host, int(port)), timeout=5)
        if data:
            sock.sendall(data)
        hostile.append(sock)
    time.sleep(0.2)  # rank 0 has accepted them before the real peers arrive
    start = time.monotonic()
    others = [threading.Thread(target=rank_main, args=(r,)) for r in range(1, WORLD)]
    for t in others:
        t.start()
    for t in [zero, *others]:
        t.join(30)
    took = time.monotonic() - start
    for sock in hostile:
        sock.close()
    for mesh in results.values():
        for sock in mesh.values():
            sock.close()
    return took, results, errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "s3cret"], ids=["no-secret", "secret"])
def test_idle_connections_do_not_delay_set_up(token):
    took, results, errors = _mesh_with_hostile_connections(token, [b"", b""])
    assert not errors, errors
    assert sorted(results) == list(range(WORLD))
    assert all(sorted(mesh) == sorted(set(range(WORLD)) - {r}) for r, mesh in results.items())
    assert took < 3.0, f"two idle connections delayed set-up by {took:.1f}s"


@pytest.mark.timeout(60)
def test_impostors_claiming_a_rank_are_dropped_with_a_secret():
    # a wrong HMAC answer and garbage: both are dropped, the real ranks still connect
    took, results, errors = _mesh_with_hostile_connections("s3cret", [b"\0" * 32, b"x" * 100])
    assert not errors, errors
    assert sorted(results) == list(range(WORLD))
    assert took < 3.0


@pytest.mark.timeout(60)
def test_a_connection_claiming_a_rank_out_of_range_is_dropped():
    # without a secret the greeting is straight away the rank: claim rank 99, then stall
    took, results, errors = _mesh_with_hostile_connections(
        None, [b"PLRBSTR1\0" + struct.pack("!I", 99), b"PLRBSTR1\0"]
    )
    assert not errors, errors
    assert sorted(results) == list(range(WORLD))
