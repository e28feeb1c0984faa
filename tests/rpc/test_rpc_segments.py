"""Large arrays between workers of one host travel in shared-memory segments: the values are
the ones sent (parity with numpy), the receiver's arrays view the segment only while it is
theirs, segments are reused and given back, and nothing is left open or in /dev/shm. The
segment path refuses what it cannot trust (a segment that is not sealed, not a pluribus
segment, smaller than announced, or from a peer that never proved it shares the host)."""

import gc
import os
import socket
import time

import numpy as np
import pytest
import rpc_cases as c
from pluribus import rpc
from pluribus.rpc import segments, transport, wire
from pluribus.rpc.api import current_agent
from pluribus.store import HashStore
from rpc_cases import run_threads

pytestmark = pytest.mark.timeout(60)

LARGE = 2**18 // 4 * 3  # float32 elements: 768 KiB, above SEGMENT_MIN


def _rng_array(seed: int, dtype=np.float32, n: int = LARGE) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 100).astype(dtype)


def _wait_given_back(agent, seconds: float = 5.0) -> tuple[int, int]:
    deadline = time.monotonic() + seconds
    while (held := agent.segment_pool.held())[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    return held


def test_large_arguments_and_results_travel_in_segments_with_the_values_sent():
    big = _rng_array(0)
    mixed = [_rng_array(1, np.float64, 40000), _rng_array(2, np.int16, 100000), "text", 7]

    def main(rank):
        if rank != 0:
            return None
        arrived, writable, doubled = rpc.rpc_sync("w1", c.inspect_large, args=(big,))
        echoed = rpc.rpc_sync("w1", c.echo, args=(mixed,))
        plus_one = rpc.rpc_sync("w1", c.add_one_in_place, args=(big,))
        small = rpc.rpc_sync("w1", c.inspect_large, args=(np.ones(8, np.float32),))
        return arrived, writable, doubled, c.in_segment(doubled), echoed, plus_one, small[0]

    arrived, writable, doubled, reply_in_segment, echoed, plus_one, small = run_threads(2, main)[0]
    assert arrived and writable and reply_in_segment
    assert not small  # small arrays stay on TCP
    np.testing.assert_array_equal(doubled, big * 2)
    (args, kwargs) = echoed
    for got, want in zip(args[0], mixed, strict=True):
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
        else:
            assert got == want
    np.testing.assert_array_equal(plus_one, _rng_array(0) + 1)
    np.testing.assert_array_equal(big, _rng_array(0))  # the caller's array is untouched
    # a mapping holds a descriptor of its segment while arrays view it; shutdown closed the rest
    assert segments.open_segment_count() >= 3
    del doubled, echoed, args, got, plus_one
    gc.collect()
    assert segments.open_segment_count() == 0


def test_a_segment_is_not_rewritten_while_the_receiver_still_views_it():
    first, second = _rng_array(3), _rng_array(4)

    def main(rank):
        if rank != 0:
            return None
        agent = current_agent()
        rpc.rpc_sync("w1", c.hold, args=(first,))  # w1 keeps a view of the segment
        rpc.rpc_sync("w1", c.hold, args=(second,))
        for _ in range(5):  # more traffic that could reuse a free segment
            rpc.rpc_sync("w1", c.scale, args=(second, 1.0))
        kept = rpc.rpc_sync("w1", c.held_values)
        lent_while_held = _wait_given_back(agent, 0.5)[0]
        rpc.rpc_sync("w1", c.drop_held)
        return kept, lent_while_held, _wait_given_back(agent)

    kept, lent_while_held, (lent_after, free_after) = run_threads(2, main)[0]
    np.testing.assert_array_equal(kept[0], first)
    np.testing.assert_array_equal(kept[1], second)
    assert lent_while_held >= 2  # the two held segments stay lent
    assert lent_after == 0  # given back once w1 dropped them
    assert 1 <= free_after <= 7  # kept for reuse (at most one per call made)


def test_segments_are_reused_across_many_calls():
    array = _rng_array(5)

    def main(rank):
        if rank != 0:
            return None
        agent = current_agent()
        for i in range(30):
            out = rpc.rpc_sync("w1", c.scale, args=(array, float(i)))
            np.testing.assert_array_equal(out, array * np.float32(i))
            del out
        return _wait_given_back(agent), segments.open_segment_count()

    (lent, free), open_now = run_threads(2, main)[0]
    assert lent == 0
    assert free <= 10  # reused: a segment is given back while the next calls go out
    assert open_now <= 20  # both workers' pools, not a segment per call and reply
    assert segments.open_segment_count() == 0


def test_shared_memory_false_keeps_large_arrays_on_tcp():
    big = _rng_array(6)

    def main(rank):
        if rank != 0:
            return None
        return rpc.rpc_sync("w1", c.inspect_large, args=(big,))

    arrived, writable, doubled = run_threads(2, main, shared_memory=False)[0]
    assert not arrived and writable
    np.testing.assert_array_equal(doubled, big * 2)


# -- what the segment path refuses -----------------------------------------------------------


def test_headers_with_unknown_or_misplaced_flags_are_refused():
    for kind, flags in ((wire.NOTE, wire.IN_SEGMENT), (wire.BYE, wire.IN_SEGMENT), (1, 2)):
        header = wire.HEADER.pack(wire.MAGIC, kind, flags, 1, 0, 2**20)
        with pytest.raises(wire.FrameError):
            wire.parse_header(header, 2**30)


def test_a_reader_without_segments_refuses_a_segment_frame():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(
            wire.HEADER.pack(wire.MAGIC, wire.REQUEST, wire.IN_SEGMENT, 1, 0, 2**20)
            + wire.LOCATOR.pack(0, 1, 1)
        )
        with pytest.raises(wire.FrameError, match="may not send"):
            wire.FrameReader(b, 2**30).read()


def test_open_mapped_refuses_what_is_not_a_sealed_segment_of_its_size():
    pid = os.getpid()
    read_end, write_end = os.pipe()
    unsealed = os.memfd_create("pluribus-rpc-segment", os.MFD_CLOEXEC)
    pool = segments.SegmentPool()
    try:
        os.ftruncate(unsealed, 2**20)
        with pytest.raises(segments.SegmentError, match="not an RPC segment"):
            segments.open_mapped(pid, read_end, 4096)
        with pytest.raises(segments.SegmentError, match="not sealed"):
            segments.open_mapped(pid, unsealed, 4096)
        data = np.arange(2**18, dtype=np.uint8)
        fd, _, serial = pool.lend([memoryview(data)], data.nbytes, peer=1)
        with pytest.raises(segments.SegmentError, match="smaller"):
            segments.open_mapped(pid, fd, 2**21)
        with pytest.raises(segments.SegmentError, match="cannot open"):
            segments.open_mapped(pid, 99999, 4096)
        np.testing.assert_array_equal(segments.open_mapped(pid, fd, data.nbytes), data)
        pool.give_back(serial, peer=2)  # not the peer it was lent to: ignored
        assert pool.held() == (1, 0)
        pool.give_back(serial, peer=1)
        assert pool.held() == (0, 1)
    finally:
        pool.close()
        for fd in (read_end, write_end, unsealed):
            os.close(fd)
    assert segments.open_segment_count() == 0


def test_a_segment_from_a_peer_that_never_proved_it_shares_the_host_is_refused():
    def check(rank):
        if rank != 0:
            return None
        agent = current_agent()
        with pytest.raises(segments.SegmentError, match="did not prove"):
            agent.open_segment(5, 3, 1, 1, 4096)
        return True

    assert run_threads(2, check)[0] is True


def test_a_forged_segment_frame_is_refused_and_the_worker_keeps_serving():
    secret = "segment-test-secret"
    rpc.init_rpc("solo", rank=0, world_size=1, store=HashStore(), timeout=10, secret=secret)
    try:
        agent = current_agent()
        host, port = agent._listener.host, agent._listener.port
        description, _ = wire.encode_body({"op": "call", "fn": "x", "timeout": 5.0}, "test")
        read_end, write_end = os.pipe()  # an fd of this very process that is no segment
        try:
            with transport.connect(host, port, secret, 0, 5.0, "solo") as sock:
                header = wire.HEADER.pack(
                    wire.MAGIC, wire.REQUEST, wire.IN_SEGMENT, 9, len(description), 2**20
                )
                sock.sendall(header + description + wire.LOCATOR.pack(read_end, 1, 1))
                frame = wire.recv_frame(sock, 2**20)
                assert frame is not None and frame[0] == wire.REPLY
                error = wire.decode_body(frame[2], frame[3])["error"]
                assert "not an RPC segment" in error[1]
        finally:
            os.close(read_end)
            os.close(write_end)
        np.testing.assert_array_equal(
            rpc.rpc_sync("solo", c.scale, args=(np.ones(LARGE, np.float32), 2.0)), 2.0
        )
    finally:
        rpc.shutdown(timeout=5)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_nothing_appears_in_dev_shm():
    def ours():  # other jobs on this machine may use /dev/shm meanwhile
        return {name for name in os.listdir("/dev/shm") if "rpc" in name}

    before = ours()
    big = _rng_array(7)

    def main(rank):
        if rank == 0:
            for _ in range(5):
                rpc.rpc_sync("w1", c.scale, args=(big, 3.0))
            assert ours() - before == set()
        return None

    run_threads(2, main)
    assert ours() - before == set()
    assert segments.open_segment_count() == 0
