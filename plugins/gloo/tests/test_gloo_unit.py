"""The gloo plugin in one process: registration, probing, addresses, the wire header, GPU
refusal, authentication at connection time, and clean shutdown."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pluribus as pb
import pytest
from pluribus.errors import AuthenticationError, PluribusError
from pluribus.plugins import backend_specs
from pluribus.store import HashStore, PrefixStore, client_handshake
from pluribus_gloo import connect, wire


def test_gloo_is_registered_and_available():
    spec, plugin = backend_specs()["gloo"]
    assert plugin == "gloo"
    assert spec.devices == ("cpu",)
    assert spec.priority == 50
    assert pb.is_gloo_available()
    status = pb.availability("gloo")
    assert status.ok and status.version == "0.1.0"


def test_gloo_probe_explains_unsupported_platforms(monkeypatch):
    from pluribus_gloo import plugin

    monkeypatch.setattr(connect.sys, "platform", "win32")
    status = plugin.probe()
    assert not status.ok
    assert "win32" in status.reason and "WSL2" in status.remedy


def test_gloo_header_round_trip_and_description():
    raw = wire.pack(
        wire.ALL_REDUCE,
        wire.dtype_code(np.float32),
        wire.op_code(pb.ReduceOp.MAX),
        channel=2**63 + 5,
        tag=-1,
        seq=7,
        count=1000,
        part=3,
        nbytes=4000,
    )
    assert len(raw) == wire.HEADER_SIZE
    h = wire.Header(raw)
    assert (h.kind, h.channel, h.tag, h.seq, h.count, h.part, h.nbytes) == (
        wire.ALL_REDUCE,
        2**63 + 5,
        -1,
        7,
        1000,
        3,
        4000,
    )
    assert wire.describe(h.kind, h.dtype, h.op, h.count) == (
        "all_reduce(float32, 1000 elements, op=MAX)"
    )
    user = wire.Header(wire.pack(wire.SEND, 1, 0, 0, (5 << 40) + 3, 0, 1, 0, 1))
    assert user.tag == (5 << 40) + 3  # int64 tags survive the trip
    with pytest.raises(ValueError):
        wire.Header(bytes(64))


def test_gloo_listen_address(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv(connect.IFNAME_ENV, raising=False)
    assert connect.listen_address({}) == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert connect.listen_address({}) == "127.0.0.1"
    monkeypatch.setenv(connect.IFNAME_ENV, "lo")
    assert connect.listen_address({}) == "127.0.0.1"
    monkeypatch.setenv(connect.IFNAME_ENV, "no-such-if0")
    with pytest.raises(PluribusError, match="no-such-if0"):
        connect.listen_address({})


@pytest.fixture
def world_of_one():
    pb.init_process_group("gloo", rank=0, world_size=1, store=HashStore(), timeout=10)
    yield pb.get_default_group()
    pb.destroy_process_group()


class _FakeCupyArray:
    """Stands in for a cupy array: the core recognises cupy by the type's module."""

    shape = (4,)
    dtype = np.dtype(np.float32)


_FakeCupyArray.__module__ = "cupy._core.core"


def test_gloo_refuses_gpu_arrays_unless_staging(world_of_one):
    group = world_of_one
    with pytest.raises(TypeError, match="PLURIBUS_GPU_STAGING=1"):
        group.backend_for(_FakeCupyArray())
    group.gpu_staging = True
    assert group.backend_for(_FakeCupyArray()) is group.backends["cpu"]
    x = np.arange(5.0)
    pb.all_reduce(x)  # world of one: in place, unchanged
    assert (x == np.arange(5.0)).all()


def _mesh(rank, size, store, token, out):
    try:
        out[rank] = connect.connect_mesh(rank, size, store, 20, token, False, 1 << 16, {})
    except BaseException as exc:
        out[rank] = exc


def test_gloo_refuses_a_peer_with_the_wrong_token_and_keeps_waiting():
    store = PrefixStore("t", HashStore())
    token = "right-token"
    out: dict = {}
    first = threading.Thread(target=_mesh, args=(0, 2, store, token, out))
    first.start()
    host, _, port = store.get("addr/0", 10).decode().rpartition(":")
    impostor = socket.create_connection((host, int(port)), timeout=10)
    with pytest.raises(AuthenticationError, match="auth token"):
        client_handshake(impostor, "wrong-token", "gloo rank 0")
    impostor.close()
    second = threading.Thread(target=_mesh, args=(1, 2, store, token, out))
    second.start()
    first.join(30)
    second.join(30)
    assert set(out[0]) == {1} and set(out[1]) == {0}, out
    for peers in out.values():
        for conn in peers.values():
            conn.sock.close()


def _open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            pass
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.parametrize("shm", ["1", "0"])
def test_gloo_destroy_releases_sockets(monkeypatch, shm):
    """Two ranks as threads of this process: after destroy no socket or segment is left."""
    monkeypatch.setenv("PLURIBUS_GLOO_SHM", shm)
    from pluribus.testing import run_ranks

    before = _open_sockets()

    def job():
        x = np.full(1000, pb.get_rank() + 1.0)
        pb.all_reduce(x)
        return float(x[0])

    assert run_ranks(job, 2, "gloo", "threads", timeout=60) == [3.0, 3.0]
    assert _open_sockets() <= before
