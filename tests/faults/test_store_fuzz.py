"""Whatever a client sends (hypothesis draws commands with honest and lying length fields, and
plain garbage), the store server neither crashes nor stops serving the other clients."""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pluribus.store import TCPStore

_field = st.one_of(
    st.binary(max_size=64).map(lambda b: struct.pack("!Q", len(b)) + b),  # honest
    st.integers(0, 2**64 - 1).map(lambda n: struct.pack("!Q", n)),  # a length, no bytes
)
_command = st.builds(
    lambda op, count, fields: struct.pack("!BI", op, count) + b"".join(fields),
    st.integers(0, 255).filter(lambda op: op != 2),  # not GET: a drawn wait could last for ever
    st.integers(0, 2**32 - 1),
    st.lists(_field, max_size=4),
)


@pytest.fixture(scope="module")
def store():
    server = TCPStore(is_master=True, auth_token="")
    yield server
    server.close()


@pytest.mark.timeout(120)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(garbage=st.lists(st.one_of(_command, st.binary(max_size=40)), min_size=1, max_size=3))
def test_garbage_never_breaks_the_store(store, garbage):
    with socket.create_connection(("127.0.0.1", store.port), timeout=5) as hostile:
        hostile.recv(9)
        try:
            hostile.sendall(b"".join(garbage))
        except OSError:
            pass  # the server hung up on it already
    store.set("alive", b"yes")
    assert store.get("alive", 5) == b"yes"
