"""What a stranger can do to a worker: nothing. Connections without the job's secret are dropped
before any byte is parsed, a pickle exploit is refused without being evaluated, and hundreds of
garbage connections (random bytes, huge length prefixes, half-open sockets) leave the worker
serving with bounded memory. The frame parser is fuzzed with hypothesis."""

import json
import os
import pickle
import socket
import struct
import threading
import time

import numpy as np
import pytest
import rpc_cases as c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pluribus import AuthenticationError, HashStore, rpc
from pluribus.rpc import transport, wire
from pluribus.rpc.api import current_agent

pytestmark = pytest.mark.timeout(120)

SECRET = "the-job-secret"


class Exploit:
    """Unpickling this runs a shell command that creates ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture(scope="module")
def server():
    """One worker serving in this process (rank 0 of a world of one)."""
    rpc.init_rpc("server", rank=0, world_size=1, store=HashStore(), timeout=20, secret=SECRET)
    agent = current_agent()
    yield agent
    rpc.shutdown(timeout=5)


def _still_serves(agent) -> None:
    assert rpc.rpc_sync("server", c.add, args=(40, 2), timeout=5) == 42
    np.testing.assert_array_equal(rpc.rpc_sync("server", c.scale, args=(np.ones(3), 2)), 2.0)


def _address(agent):
    return agent._listener.host, agent._listener.port


def _raw(agent) -> socket.socket:
    sock = socket.create_connection(_address(agent), timeout=5)
    hello = sock.recv(40)
    assert hello.startswith(transport.HELLO)
    return sock


def _authenticated(agent) -> socket.socket:
    host, port = _address(agent)
    return transport.connect(host, port, SECRET, 0, 5.0, "the test server")


def _request(call_id, value) -> bytes:
    description, pieces = wire.encode_body(value, "test")
    heap = b"".join(bytes(p) for p in pieces)
    header = wire.HEADER.pack(wire.MAGIC, wire.REQUEST, 0, call_id, len(description), len(heap))
    return header + description + heap


def _read_reply(sock):
    frame = wire.recv_frame(sock, 2**20)
    assert frame is not None, "the worker hung up without a reply"
    kind, call_id, description, heap = frame
    assert kind == wire.REPLY
    return call_id, wire.decode_body(description, heap)


def _closed(sock, timeout=5.0) -> bool:
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_a_wrong_secret_and_no_secret_are_refused(server):
    host, port = _address(server)
    with pytest.raises(AuthenticationError, match="refused this worker's secret"):
        transport.connect(host, port, "not-the-secret", 0, 5.0, "worker 'server'")
    # no secret: a client that sends a request straight away is dropped unparsed
    sock = _raw(server)
    sock.sendall(_request(1, {"op": "call", "fn": "rpc_cases.add", "args": (1, 2), "timeout": 5}))
    assert _closed(sock)
    sock.close()
    # a worker of another job (another secret) cannot call this one
    store, errors = HashStore(), []

    def stranger():
        try:
            rpc.init_rpc("stranger", rank=0, world_size=1, store=store, secret="other-job")
            agent = current_agent()
            agent._addresses[0] = (host, port)  # point it at the server
            rpc.rpc_sync("stranger", c.add, args=(1, 2))
        except BaseException as exc:
            errors.append(exc)
        finally:
            rpc.shutdown(graceful=False, timeout=2)

    thread = threading.Thread(target=stranger)
    thread.start()
    thread.join(20)
    assert isinstance(errors[0], AuthenticationError), errors
    assert server._listener.refused >= 2
    _still_serves(server)


def test_a_pickle_exploit_is_refused_without_being_evaluated(server, tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Exploit(marker))
    # through the API: refused at the caller, nothing sent
    with pytest.raises(TypeError, match="Exploit, which cannot travel by RPC"):
        rpc.rpc_sync("server", c.echo, args=(Exploit(marker),))
    # the raw pickle before authenticating: dropped
    sock = _raw(server)
    sock.sendall(payload)
    assert _closed(sock)
    sock.close()
    # the raw pickle as a frame's body, from an authenticated peer: a malformed message
    sock = _authenticated(server)
    header = wire.HEADER.pack(wire.MAGIC, wire.REQUEST, 0, 7, len(payload), 0)
    sock.sendall(header + payload)
    call_id, reply = _read_reply(sock)
    assert call_id == 7 and "malformed message" in reply["error"][1]
    # pickled bytes as an argument travel as bytes, and stay bytes
    back = rpc.rpc_sync("server", c.echo, args=(payload,))
    assert back == ((payload,), {})
    sock.close()
    assert not marker.exists()
    _still_serves(server)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_two_hundred_garbage_connections_leave_the_worker_serving_with_bounded_memory(server):
    rng = np.random.default_rng(0)
    _still_serves(server)
    before = _rss_bytes()
    connections_before = len(server._connections)
    held = []
    for i in range(200):
        kind = i % 5
        if kind == 0:  # random bytes instead of the handshake
            sock = _raw(server)
            sock.sendall(rng.bytes(int(rng.integers(1, 4096))))
            sock.close()
        elif kind == 1:  # a huge length prefix instead of the handshake
            sock = _raw(server)
            sock.sendall(struct.pack("<Q", 2**62) * 9)
            sock.close()
        elif kind == 2:  # half-open: connects, says nothing, stays
            held.append(socket.create_connection(_address(server), timeout=5))
        elif kind == 3:  # half a handshake, then silence
            sock = _raw(server)
            sock.sendall(b"\x00" * 20)
            held.append(sock)
        else:  # authenticated, then a frame header claiming an enormous body
            sock = _authenticated(server)
            sock.sendall(wire.HEADER.pack(wire.MAGIC, wire.REQUEST, 0, 1, 2**40, 2**62))
            call_id, reply = _read_reply(sock)
            assert "the limit is" in reply["error"][1]
            assert _closed(sock)
            sock.close()
    _still_serves(server)
    assert server._listener.pending <= transport.MAX_PENDING
    deadline = time.monotonic() + 5
    while len(server._connections) > connections_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(server._connections) == connections_before
    assert _rss_bytes() - before < 64 * 2**20
    for sock in held:
        sock.close()
    _still_serves(server)


# -- the frame parser, fuzzed ------------------------------------------------------------------


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(header=st.binary(min_size=wire.HEADER.size, max_size=wire.HEADER.size))
def test_any_header_is_a_frame_error_or_within_the_limits(header, no_unpickling):
    try:
        kind, _, _, description, heap = wire.parse_header(header, 2**20)
    except wire.FrameError:
        return
    assert kind in wire.KINDS and description <= wire.MAX_DESCRIPTION and heap <= 2**20


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["tuple", "dict", "bytes", "array", "scalar", "ext", "x"]),
            children,
            max_size=2,
        )
    ),
    max_leaves=20,
)


_VALID_DESCRIPTION, _VALID_PIECES = wire.encode_body(
    {"op": "call", "args": (np.arange(6.0).reshape(2, 3), b"xy", [1, None]), "k": {"a": 1.5}}, "t"
)


@st.composite
def _mutated(draw):
    """A real description with a few bytes changed."""
    data = bytearray(_VALID_DESCRIPTION)
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    description=st.one_of(
        st.binary(max_size=200), _json.map(lambda t: json.dumps(t).encode()), _mutated()
    ),
    heap=st.one_of(st.binary(max_size=256), st.just(b"".join(bytes(p) for p in _VALID_PIECES))),
)
def test_any_body_decodes_or_is_a_frame_error_never_code(description, heap, no_unpickling):
    try:
        wire.decode_body(description, heap)
    except wire.FrameError:
        pass


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(stream=st.binary(min_size=1, max_size=2048), authenticated=st.booleans())
def test_any_byte_stream_from_a_peer_leaves_the_worker_serving(server, stream, authenticated):
    sock = _authenticated(server) if authenticated else _raw(server)
    try:
        sock.sendall(stream)
    except OSError:
        pass
    sock.close()
    assert rpc.rpc_sync("server", c.add, args=(1, 1), timeout=5) == 2


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**62), 2**62)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.builds(
        lambda shape, dtype: (np.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape),
        st.lists(st.integers(0, 3), max_size=3),
        st.sampled_from(["float32", "int64", "uint8", "bool", "complex128"]),
    ),
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=4) | st.integers(0, 9), children, max_size=3)
    ),
    max_leaves=12,
)


def _same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=_values)
def test_every_value_that_can_travel_arrives_unchanged(value, no_unpickling):
    description, pieces = wire.encode_body(value, "test")
    heap = np.frombuffer(b"".join(bytes(p) for p in pieces), dtype=np.uint8)
    assert _same(value, wire.decode_body(description, heap))


@pytest.mark.parametrize("name", ["08", "(2,3)f8", "f8,i4", "|O8", "O", "object", 7, None])
def test_a_forged_dtype_name_is_a_frame_error(name, no_unpickling):
    """np.dtype parses much more than names (shapes with a literal parser, field lists): only
    names of the form the sender writes reach it (found by the fuzzer above)."""
    description = json.dumps({"array": [name, [1], 0, 8]}).encode()
    with pytest.raises(wire.FrameError, match="cannot be received"):
        wire.decode_body(description, bytes(8))
