"""The small-call path: calls with plain arguments travel as CALL frames and plain results as
RESULT frames (JSON, no codec), handlers run on the connection's reading thread, and a waiting
caller's reply lands in a ``Reply``. Values must arrive exactly as the codec path delivers
them; handlers that raise, block or call other workers must behave as on the pool; malformed
CALL frames from an authenticated peer are refused and the worker keeps serving. Workers of one
host connect through the listener's name in the abstract Unix namespace, which must hold the
same handshake and fall back to TCP where it cannot be reached."""

import math
import socket
import threading
import time
import types

import numpy as np
import pytest
import rpc_cases as c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pluribus import AuthenticationError, HashStore, rpc
from pluribus.rpc import api, transport, wire
from pluribus.rpc import server as server_module
from pluribus.rpc.api import current_agent
from pluribus.rpc.futures import Reply
from rpc_cases import run_threads

pytestmark = pytest.mark.timeout(60)

SECRET = "small-calls-secret"


@pytest.fixture
def frame_kinds(monkeypatch):
    """The kinds of the frames this process writes, in order."""
    kinds: list[int] = []
    real = wire.send_frame

    def recording(sock, kind, *args, **kwargs):
        kinds.append(kind)
        return real(sock, kind, *args, **kwargs)

    monkeypatch.setattr(wire, "send_frame", recording)
    return kinds


def test_plain_calls_travel_as_call_frames_and_arrive_exactly(frame_kinds):
    plain = (0, -(2**70), 2.5, math.inf, "é\u2603", None, True, [1, [2.0, "x"], []])

    def main(rank):
        if rank != 0:
            return None
        frame_kinds.clear()
        echoed = rpc.rpc_sync("w1", c.echo, args=plain, kwargs={"k": [False, None]})
        kinds_echo = list(frame_kinds)
        frame_kinds.clear()
        added = rpc.rpc_sync("w1", c.add, args=(2, 3))
        kinds_add = list(frame_kinds)
        nan = rpc.rpc_async("w1", c.add, args=(math.nan, 1.0)).wait(20)
        return echoed, kinds_echo, added, kinds_add, nan

    echoed, kinds_echo, added, kinds_add, nan = run_threads(2, main)[0]
    # echo returns a tuple, which only the codec carries: CALL out, REPLY back
    assert kinds_echo == [wire.CALL, wire.REPLY]
    assert echoed == (plain, {"k": [False, None]})
    assert [type(v) for v in echoed[0]] == [type(v) for v in plain]
    assert kinds_add == [wire.CALL, wire.RESULT]
    assert added == 5 and type(added) is int
    assert math.isnan(nan)


def test_values_json_cannot_carry_exactly_take_the_codec_path(frame_kinds):
    """A tuple, a numpy scalar (even np.float64, a float subclass), bytes, an array or a dict
    argument goes as a REQUEST frame and arrives as the codec delivers it."""
    cases = [(1, 2), np.float32(1.5), np.float64(2.5), b"\x00", np.arange(3), {"a": 1}, {1: 2}]

    def main(rank):
        if rank != 0:
            return None
        out = []
        for value in cases:
            frame_kinds.clear()
            args, _ = rpc.rpc_sync("w1", c.echo, args=(value,))
            out.append((args[0], list(frame_kinds)))
        return out

    for value, (back, kinds) in zip(cases, run_threads(2, main)[0], strict=True):
        assert kinds == [wire.REQUEST, wire.REPLY]
        description, pieces = wire.encode_body(value, "test")
        expected = wire.decode_body(description, b"".join(bytes(p) for p in pieces))
        assert type(back) is type(expected)
        np.testing.assert_array_equal(back, expected)


@rpc.expose(name="small_calls.wait_for")
def wait_for(seconds):
    """Blocks its thread (not an RPC wait, so nothing hands reading over but the watchdog)."""
    time.sleep(seconds)
    return seconds


def test_an_inline_handler_that_raises_or_blocks_leaves_the_connection_serving():
    def main(rank):
        if rank != 0:
            return None
        with pytest.raises(rpc.RemoteError, match="KeyError") as raised:
            rpc.rpc_sync("w1", c.fail, args=("missing",))
        assert "w1" in str(raised.value) and "fail" in raised.value.remote_traceback
        assert rpc.rpc_sync("w1", c.add, args=(1, 2)) == 3  # the reading thread lives on
        # a handler blocking the reading thread for 2 s: calls behind it on the same
        # connection are served by the thread that takes reading over
        slow = rpc.rpc_async("w1", wait_for, args=(2.0,))
        time.sleep(0.1)
        quick = [rpc.rpc_sync("w1", c.add, args=(i, 1), timeout=10) for i in range(5)]
        slow_done_before = slow.done()
        return quick, slow_done_before, slow.wait(10)

    quick, slow_done_before, slow = run_threads(2, main)[0]
    assert quick == [1, 2, 3, 4, 5]
    assert not slow_done_before
    assert slow == 2.0


def test_nested_small_calls_from_inline_handlers_with_one_pool_thread():
    """ping_pong's arguments are plain, so every hop is a CALL run on a reading thread that
    must hand reading over while it waits for the next hop."""

    def main(rank):
        if rank != 0:
            return None
        return rpc.rpc_sync("w1", c.ping_pong, args=(12, "w0")), rpc.rpc_sync(
            "w2", c.relay, args=(["w1", "w0", "w2"], 7)
        )

    depth, relayed = run_threads(3, main, num_worker_threads=1, max_threads=64)[0]
    assert depth == 12
    assert relayed == ["w2", "w1", "w0", "w2", 7]


def test_shutdown_waits_for_a_sync_call_in_flight_on_another_thread():
    def main(rank):
        if rank != 0:
            return None
        got = []
        agent = current_agent()

        def call():  # a second thread of worker w0 (threads of a test share one process)
            api._bind_thread(agent)
            got.append(rpc.rpc_sync("w1", c.sleep, (0.5,)))

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.1)
        return got, caller

    got, caller = run_threads(2, main)[0]  # run_threads shuts down right after main
    caller.join(5)
    assert got == [0.5]


def test_a_reply_is_settled_once_and_wakes_any_waiter():
    reply = Reply()
    assert not reply.done() and not reply.wait(0.01)
    woken = []
    waiters = [threading.Thread(target=lambda: woken.append(reply.wait(5))) for _ in range(2)]
    for thread in waiters:
        thread.start()
    reply.set_result([1])
    for thread in waiters:
        thread.join(5)
    assert woken == [True, True] and reply.result() == [1]
    failed = Reply()
    failed.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        failed.result()


def test_a_stale_hand_over_never_starts_a_second_reader():
    """The watchdog reads a connection's inline run without its lock: by the time it hands
    over, that handler may have finished and its thread be reading again."""
    a, b = socket.socketpair()
    agent = types.SimpleNamespace(workers=[], max_message=2**20, thread_prefix="t")
    connection = server_module.ServerConnection(agent, a, 0)
    started = []
    connection.start = started.append
    try:
        run = (0, time.monotonic())
        connection.hand_over(run)  # no handler runs: nothing to hand over
        connection.inline_run = run
        connection.hand_over((0, run[1] - 1))  # an older run of the same thread
        assert started == []
        connection.hand_over(run)
        connection.hand_over(run)  # already handed over
        assert started == [1]
    finally:
        a.close()
        b.close()


# -- CALL frames from the network ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    rpc.init_rpc("server", rank=0, world_size=1, store=HashStore(), timeout=20, secret=SECRET)
    yield current_agent()
    rpc.shutdown(timeout=5)


def _call_frame(call_id, description: bytes, heap: int = 0) -> bytes:
    return wire.HEADER.pack(wire.MAGIC, wire.CALL, 0, call_id, len(description), heap) + (
        description
    )


def _connect(agent):
    return transport.connect(
        agent._listener.host, agent._listener.port, SECRET, 0, 5.0, "the test server"
    )


@pytest.mark.parametrize(
    "description, error",
    [
        (b'{"fn": 1}', "malformed call"),
        (b'["__main__.nothing", [], {}, 5.0]', "not registered"),
        (b"[7, [], {}, 5.0]", "not a name"),
        (b'["rpc_cases.add", {}, [], 5.0]', "not a list and an object"),
        (b'["rpc_cases.add", [1, 2], {}, "soon"]', "without a timeout"),
        (b'["rpc_cases.add", [1, 2], {}, 5.0] trailing', "bytes after"),
        (b"\xff\xfe", "malformed call"),
        (b"[" * 5000, "malformed call"),
        (b'["rpc_cases.add", [1], {}, 5.0]', "TypeError"),
    ],
)
def test_a_malformed_call_frame_is_answered_with_an_error(server, description, error):
    with _connect(server) as sock:
        sock.sendall(_call_frame(9, description))
        kind, call_id, reply, heap = wire.recv_frame(sock, 2**20)
        assert (kind, call_id) == (wire.REPLY, 9)
        assert error in str(wire.decode_body(reply, heap)["error"])
        sock.sendall(_call_frame(10, b'["rpc_cases.add", [40, 2], {}, 5.0]'))
        kind, call_id, result, _ = wire.recv_frame(sock, 2**20)
        assert (kind, call_id, wire.decode_result(result)) == (wire.RESULT, 10, 42)


def test_a_call_frame_with_array_bytes_is_a_frame_error_and_hangs_up(server):
    with pytest.raises(wire.FrameError):
        wire.parse_header(_call_frame(1, b"[]", heap=8)[: wire.HEADER.size], 2**20)
    with _connect(server) as sock:
        sock.sendall(_call_frame(1, b"[]", heap=8) + bytes(8))
        kind, _, reply, heap = wire.recv_frame(sock, 2**20)
        assert kind == wire.REPLY and "arrays" in str(wire.decode_body(reply, heap)["error"])
        sock.settimeout(5)
        try:
            assert sock.recv(1) == b""  # hung up
        except ConnectionResetError:
            pass
    assert rpc.rpc_sync("server", c.add, args=(1, 1), timeout=5) == 2


_plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3),
    max_leaves=10,
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(args=st.lists(_plain, max_size=4), kwargs=st.dictionaries(st.text(max_size=4), _plain))
def test_a_plain_call_decodes_to_what_the_codec_would_give(args, kwargs):
    description = wire.encode_call("m.f", tuple(args), kwargs, 5.0)
    assert description is not None
    name, got_args, got_kwargs, timeout = wire.decode_call(description)
    request, pieces = wire.encode_body({"a": tuple(args), "k": kwargs}, "test")
    assert not pieces
    assert {"a": got_args, "k": got_kwargs} == wire.decode_body(request, b"")
    assert (name, timeout) == ("m.f", 5.0)
    for value in (args, kwargs.get("x")):
        result = wire.encode_result(value)
        assert result is not None and wire.decode_result(result) == value


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(description=st.binary(max_size=120))
def test_any_call_description_decodes_or_is_a_frame_error(description):
    try:
        name, args, kwargs, timeout = wire.decode_call(description)
    except wire.FrameError:
        return
    assert isinstance(name, str) and isinstance(args, tuple) and isinstance(kwargs, dict)


# -- workers of one host: the listener's local name ---------------------------------------------


def _family_to_w1():
    """The address family of this worker's connection to w1."""
    return current_agent()._channels[1].sock.family


def test_workers_of_one_host_connect_through_the_local_listener():
    def main(rank):
        if rank != 0:
            return None
        assert rpc.rpc_sync("w1", c.add, args=(1, 2)) == 3
        np.testing.assert_array_equal(
            rpc.rpc_sync("w1", c.scale, args=(np.arange(70000.0), 2)), np.arange(70000.0) * 2
        )
        return _family_to_w1()

    assert run_threads(2, main)[0] == socket.AF_UNIX


def test_without_a_local_listener_workers_use_tcp(monkeypatch):
    monkeypatch.setattr(transport, "_listen_locally", lambda host, port: None)

    def main(rank):
        if rank != 0:
            return None
        assert rpc.rpc_sync("w1", c.add, args=(1, 2)) == 3
        return _family_to_w1()

    assert run_threads(2, main)[0] == socket.AF_INET


def test_a_local_name_nobody_listens_on_falls_back_to_tcp(server):
    host, port = server._listener.host, server._listener.port
    with socket.create_server(("127.0.0.1", 0)) as tcp_only:  # has no local name
        sock = transport._open(*tcp_only.getsockname()[:2], True, 5.0)
        assert sock.family == socket.AF_INET
        sock.close()
    sock = transport._open(host, port, True, 5.0)
    assert sock.family == socket.AF_UNIX
    sock.close()


def test_the_local_listener_refuses_a_wrong_secret_and_survives_garbage(server):
    host, port = server._listener.host, server._listener.port
    refused = server._listener.refused
    with pytest.raises(AuthenticationError, match="refused this worker's secret"):
        transport.connect(host, port, "not-the-secret", 0, 5.0, "worker 'server'", True)
    assert server._listener.refused == refused + 1
    rng = np.random.default_rng(3)
    garbage = []
    for i in range(60):
        sock = transport._open(host, port, True, 5.0)
        assert sock.family == socket.AF_UNIX
        if i % 3 == 0:
            sock.sendall(rng.bytes(200))  # random bytes
        elif i % 3 == 1:
            sock.sendall(wire.HEADER.pack(wire.MAGIC, wire.CALL, 0, 1, 2**40, 0))  # no secret
        garbage.append(sock)  # and every third one half-open
    assert rpc.rpc_sync("server", c.add, args=(2, 2), timeout=5) == 4
    assert server._listener.pending <= transport.MAX_PENDING
    for sock in garbage:
        sock.close()
