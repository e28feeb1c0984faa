"""The rendezvous stores: every operation, timeouts that name the key, and the auth handshake."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from pluribus import (
    AuthenticationError,
    DistTimeoutError,
    FileStore,
    HashStore,
    PrefixStore,
    TCPStore,
)


@pytest.fixture(params=["hash", "file", "tcp"])
def store(request, tmp_path):
    if request.param == "hash":
        s = HashStore(timeout=5)
    elif request.param == "file":
        s = FileStore(tmp_path / "store", timeout=5)
    else:
        s = TCPStore("127.0.0.1", 0, is_master=True, timeout=5, auth_token="")
    yield s
    s.close()


def test_set_get_add_compare_delete(store):
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("counter", 3) == 3
    assert store.add("counter", -1) == 2
    assert store.compare_set("cas", "", "first") == b"first"
    assert store.compare_set("cas", "wrong", "second") == b"first"
    assert store.compare_set("cas", "first", "second") == b"second"
    assert store.check(["a", "counter"]) and not store.check(["a", "missing"])
    assert store.delete("a") and not store.delete("a")
    assert not store.check(["a"])


def test_get_waits_for_a_later_set(store):
    setter = threading.Timer(0.2, store.set, ("late", b"v"))
    setter.start()
    start = time.monotonic()
    assert store.get("late", timeout=5) == b"v"
    assert time.monotonic() - start >= 0.15
    setter.join(5)  # its set() may still await the reply: finish before the store closes


def test_wait_timeout_names_key_and_time(store):
    start = time.monotonic()
    with pytest.raises(DistTimeoutError, match=r"missing-key.*0\.[0-9]s"):
        store.get("missing-key", timeout=0.3)
    assert 0.25 < time.monotonic() - start < 3
    with pytest.raises(DistTimeoutError, match="other-key"):
        store.wait(["other-key"], timeout=0.2)


def test_prefix_store_namespaces(store):
    a, b = PrefixStore("a", store), PrefixStore("b", store)
    a.set("k", b"1")
    b.set("k", b"2")
    assert a.get("k") == b"1" and b.get("k") == b"2"
    assert store.get("a/k") == b"1"
    assert a.add("n", 5) == 5 and not b.check(["n"])


def test_tcp_store_clients_share_data():
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=5, auth_token="")
    client = TCPStore("127.0.0.1", server.port, timeout=5, auth_token="")
    try:
        client.set("x", b"from client")
        assert server.get("x") == b"from client"
        assert [client.add("n", 1) for _ in range(3)] == [1, 2, 3]
        # a get blocked in one thread does not stop another thread's set
        got = []
        waiter = threading.Thread(target=lambda: got.append(client.get("later", timeout=5)))
        waiter.start()
        time.sleep(0.1)
        client.set("later", b"ok")
        waiter.join(5)
        assert got == [b"ok"]
    finally:
        client.close()
        server.close()


def test_tcp_store_binds_loopback_by_default():
    server = TCPStore(is_master=True, timeout=5, auth_token="")
    try:
        assert server._server.listener.getsockname()[0] == "127.0.0.1"
    finally:
        server.close()


def test_auth_token_refuses_strangers_without_disturbing_the_job(caplog):
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=5, auth_token="s3cret")
    member = TCPStore("127.0.0.1", server.port, timeout=5, auth_token="s3cret")
    try:
        member.set("job", b"running")
        with caplog.at_level(logging.WARNING, logger="pluribus.store"):
            with pytest.raises(AuthenticationError, match="refused"):
                TCPStore("127.0.0.1", server.port, timeout=5, auth_token="wrong")
            with pytest.raises(AuthenticationError, match="PLURIBUS_AUTH_TOKEN"):
                TCPStore("127.0.0.1", server.port, timeout=5, auth_token="")
            # a raw socket that sends garbage instead of the answer is refused too
            raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            raw.recv(64)
            raw.sendall(b"x" * 32)
            assert raw.recv(1) == b"\x00"
            raw.close()
        assert "refused a connection" in caplog.text
        # the member is undisturbed
        assert member.get("job") == b"running"
        assert member.add("n", 2) == 2
    finally:
        member.close()
        server.close()


def test_auth_token_from_environment(monkeypatch):
    monkeypatch.setenv("PLURIBUS_AUTH_TOKEN", "from-env")
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
    try:
        client = TCPStore("127.0.0.1", server.port, timeout=5)
        client.set("k", b"v")
        client.close()
        monkeypatch.setenv("PLURIBUS_AUTH_TOKEN", "another")
        with pytest.raises(AuthenticationError):
            TCPStore("127.0.0.1", server.port, timeout=5)
    finally:
        server.close()


def test_unreachable_store_times_out_with_advice():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(DistTimeoutError, match="MASTER_ADDR/MASTER_PORT"):
        TCPStore("127.0.0.1", port, timeout=0.5, auth_token="")
