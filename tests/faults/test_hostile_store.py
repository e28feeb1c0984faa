"""A hostile client of the store: length fields are bounded before anything is allocated."""

from __future__ import annotations

import socket
import struct
import tracemalloc

import pytest
from pluribus.store import TCPStore


def _hostile_command(announced: int) -> bytes:
    """op SET, one field, announcing ``announced`` bytes and sending four of them (17 bytes)."""
    return struct.pack("!BIQ", 1, 1, announced) + b"abcd"


@pytest.mark.timeout(30)
def test_a_huge_announced_field_is_refused_without_allocating_it():
    store = TCPStore(is_master=True, auth_token="")
    try:
        tracemalloc.start()
        with socket.create_connection(("127.0.0.1", store.port), timeout=5) as hostile:
            assert hostile.recv(9).startswith(b"PLRBSTR1")  # no secret: straight to commands
            hostile.sendall(_hostile_command(256 << 20))
            # the server hangs up on it rather than waiting for 256 MiB
            try:
                assert hostile.recv(1) == b""
            except ConnectionResetError:
                pass  # unread bytes make the kernel reset rather than close
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 16 << 20, f"the store allocated {peak >> 20} MiB for a 17-byte command"
        store.set("still", "serving")
        assert store.get("still", 5) == b"serving"
    finally:
        tracemalloc.stop()
        store.close()


@pytest.mark.timeout(30)
def test_an_announced_length_costs_memory_only_as_bytes_arrive():
    store = TCPStore(is_master=True, auth_token="")
    try:
        tracemalloc.start()
        with socket.create_connection(("127.0.0.1", store.port), timeout=5) as hostile:
            hostile.recv(9)
            hostile.sendall(_hostile_command(32 << 20))  # within the limit, never sent
            hostile.settimeout(0.5)
            with pytest.raises(TimeoutError):
                hostile.recv(1)  # the server waits for the bytes ...
            _, peak = tracemalloc.get_traced_memory()
        assert peak < 8 << 20, f"the store allocated {peak >> 20} MiB before any byte arrived"
    finally:
        tracemalloc.stop()
        store.close()


def test_a_client_refuses_a_value_the_server_would_drop():
    from pluribus import store as store_module

    store = TCPStore(is_master=True, auth_token="")
    try:
        with pytest.raises(ValueError, match="PLURIBUS_STORE_MAX_VALUE_BYTES"):
            store.set("big", b"x" * (store_module.MAX_FIELD_BYTES + 1))
        store.set("small", b"ok")  # the connection is still good
        assert store.get("small", 5) == b"ok"
    finally:
        store.close()
