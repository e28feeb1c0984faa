"""The RPC API with workers as threads of this process: fast, and every path is the real one
(TCP on loopback, the handshake, the pool). Results are checked against computing the same
thing locally."""

import threading
import time

import numpy as np
import pytest
import rpc_cases as c
from pluribus import DistTimeoutError, PeerError, PluribusError, rpc
from rpc_cases import run_threads

pytestmark = pytest.mark.timeout(60)


def test_sync_async_and_addressing_by_name_rank_and_info():
    def main(rank):
        if rank != 0:
            return None
        info = rpc.get_worker_info("w1")
        assert (info.name, info.id) == ("w1", 1)
        assert rpc.get_worker_info() == rpc.WorkerInfo("w0", 0)
        out = [rpc.rpc_sync(to, c.add, args=(2, 3)) for to in ("w1", 1, info)]
        futures = [rpc.rpc_async("w1", c.add, args=(i, 10)) for i in range(20)]
        out.append([f.wait() for f in futures])
        out.append(rpc.rpc_sync("w1", c.echo, args=(1, "x"), kwargs={"k": [None, True, 2.5]}))
        out.append(rpc.rpc_sync("w0", c.whoami))  # a call to oneself works too
        out.append(rpc.rpc_async("w1", c.add, args=(1, 1)).then(lambda f: f.value() * 10).wait())
        # a callback may itself call a worker (it runs off the connection's reading role)
        chained = rpc.rpc_async("w1", c.add, args=(1, 1)).then(
            lambda f: rpc.rpc_sync("w1", c.add, args=(f.value(), 100), timeout=5)
        )
        out.append(chained.wait(10))
        return out

    out = run_threads(2, main)[0]
    deadline = time.monotonic() + 5  # shutdown leaves no thread behind
    while any(t.name.startswith("pluribus-rpc") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.01)
    assert out[:3] == [5, 5, 5]
    assert out[3] == [i + 10 for i in range(20)]
    assert out[4] == ((1, "x"), {"k": [None, True, 2.5]})
    assert out[5] == "w0"
    assert out[6] == 20
    assert out[7] == 102


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint16", "complex64", "bool"])
def test_arrays_travel_as_raw_bytes_with_dtype_and_shape(dtype):
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((5, 7)) * 10).astype(dtype)
    strided = np.arange(40, dtype=np.float64).reshape(5, 8)[:, ::2]  # not contiguous

    def main(rank):
        if rank == 0:
            return (
                rpc.rpc_sync("w1", c.scale, args=(array, 2)),
                rpc.rpc_sync("w1", c.echo, args=(strided, np.float32(1.5), b"\x00\x01")),
                rpc.rpc_sync("w1", c.scale, args=(np.zeros((0, 3), dtype=dtype), 1)),
            )

    scaled, ((back, scalar, raw), _), empty = run_threads(2, main)[0]
    np.testing.assert_array_equal(scaled, array * 2)
    assert scaled.dtype == (array * 2).dtype and scaled.shape == array.shape
    np.testing.assert_array_equal(back, strided)
    assert scalar == np.float32(1.5) and isinstance(scalar, np.float32)
    assert raw == b"\x00\x01"
    assert empty.shape == (0, 3)


def test_remote_errors_name_the_worker_and_carry_the_traceback():
    def main(rank):
        if rank != 0:
            return None
        with pytest.raises(rpc.RemoteError) as info:
            rpc.rpc_sync("w1", c.fail, args=("no such key",))
        error = info.value
        assert error.worker == "w1" and error.remote_type == "KeyError"
        assert "rpc_cases.py" in error.remote_traceback and "in fail" in error.remote_traceback
        assert "worker 'w1' raised KeyError" in str(error)
        with pytest.raises(rpc.RemoteError, match="ValueError: boom"):
            with rpc.remote("w1", c.Counter) as counter:
                counter.rpc_sync().boom()
        # a result that cannot travel is the callee's error, reported to the caller
        with pytest.raises(rpc.RemoteError, match="builtins.set, which cannot travel"):
            rpc.rpc_sync("w1", c.make_unsendable)
        return rpc.rpc_sync("w1", c.add, args=(1, 1))  # and the worker keeps serving

    assert run_threads(2, main)[0] == 2


def test_bad_input_is_refused_at_the_caller_before_anything_is_sent():
    def not_exposed():
        return 1

    def main(rank):
        if rank != 0:
            return None
        with pytest.raises(TypeError, match="is not registered for RPC"):
            rpc.rpc_sync("w1", not_exposed)
        with pytest.raises(TypeError, match=r"builtins.set, which cannot travel by RPC"):
            rpc.rpc_sync("w1", c.echo, args=({1, 2},))
        with pytest.raises(TypeError, match="builtin_function_or_method, which cannot travel"):
            rpc.rpc_async("w1", c.echo, kwargs={"f": print})
        with pytest.raises(ValueError, match="there is no worker 'w9'; the workers are 'w0', 'w1'"):
            rpc.rpc_sync("w9", c.add, args=(1, 2))
        with pytest.raises(ValueError, match="positive number of seconds"):
            rpc.rpc_sync("w1", c.add, args=(1, 2), timeout=0)
        with pytest.raises(TypeError, match="args must be a tuple"):
            rpc.rpc_sync("w1", c.add, args=5)
        # a name the callee never registered: its error, and it keeps serving
        with pytest.raises(rpc.RemoteError, match="'nope.f' is not registered on this worker"):
            rpc.rpc_sync("w1", "nope.f")
        return rpc.rpc_sync("w1", c.add, args=(2, 2))

    assert run_threads(2, main)[0] == 4


def test_a_call_after_shutdown_is_an_error():
    def main(rank):
        return None

    run_threads(1, main)
    with pytest.raises(PluribusError, match="init_rpc"):
        rpc.rpc_sync("w0", c.add, args=(1, 2))


def test_every_call_has_a_timeout():
    def main(rank):
        if rank != 0:
            return None
        start = time.monotonic()
        with pytest.raises(DistTimeoutError, match=r"rpc_sync\(.*sleep\) on worker 'w1'"):
            rpc.rpc_sync("w1", c.sleep, args=(2.0,), timeout=0.2)
        future = rpc.rpc_async("w1", c.sleep, args=(2.0,), timeout=0.2)
        with pytest.raises(DistTimeoutError, match="did not finish within 0.2s"):
            future.wait()
        elapsed = time.monotonic() - start
        return elapsed

    assert run_threads(2, main)[0] < 1.5


def test_nested_calls_across_three_workers():
    def main(rank):
        if rank == 0:
            return rpc.rpc_sync("w1", c.relay, args=(["w2", "w0", "w1", "w2"], "x"))

    assert run_threads(3, main)[0] == ["w1", "w2", "w0", "w1", "w2", "x"]


def test_deep_nesting_does_not_deadlock_a_pool_of_one_thread():
    """Each handler waits for a handler on the other worker, 40 deep, with one handler thread
    per worker: only the pool's giving up its place while waiting lets this finish."""

    def main(rank):
        return rpc.rpc_sync("w1", c.ping_pong, args=(40, "w0")) if rank == 0 else None

    assert run_threads(2, main, num_worker_threads=1)[0] == 40


def test_rref_counts_across_three_workers():
    """w0 makes a Counter on w1 and hands the RRef to w2, which keeps it. The value lives while
    any worker holds a handle and is freed after the last one is released."""

    def main(rank):
        if rank != 0:
            return None
        counter = rpc.remote("w1", c.Counter, args=(10,))
        rid = counter.id
        assert counter.owner_name() == "w1" and not counter.is_owner()
        assert counter.rpc_sync().add(5) == 15
        assert rpc.rpc_sync("w1", c.owned_count, args=(rid,)) == 1
        rpc.rpc_sync("w2", c.keep, args=(counter,))  # w2 now holds a handle
        assert rpc.rpc_sync("w1", c.owned_count, args=(rid,)) == 2
        counter.release()
        assert rpc.rpc_sync("w1", c.owned_count, args=(rid,)) == 1  # w2's keeps it alive
        with pytest.raises(PluribusError, match="after release"):
            counter.to_here()
        # the owner passes a handle on too: w1 -> w2 through a nested call
        made = rpc.remote("w1", c.array_example)
        np.testing.assert_array_equal(
            rpc.rpc_sync("w2", c.to_here_of, args=(made,)), c.array_example()
        )
        made.release()
        rpc.rpc_sync("w2", c.drop_kept)
        deadline = time.monotonic() + 5
        while rpc.rpc_sync("w1", c.owned_total) and time.monotonic() < deadline:
            time.sleep(0.01)  # the handle passed to w2 above is released when collected
        return rpc.rpc_sync("w1", c.owned_count, args=(rid,)), rpc.rpc_sync("w1", c.owned_total)

    assert run_threads(3, main)[0] == (0, 0)


def test_rref_methods_values_and_locally_owned_references():
    def main(rank):
        if rank != 0:
            return None
        with rpc.remote("w1", c.Counter, args=(1,)) as counter:
            futures = [counter.rpc_async().add(1) for _ in range(10)]
            assert sorted(f.wait() for f in futures) == list(range(2, 12))
            with counter.remote().get() as value:  # the result stays on w1
                assert value.owner_name() == "w1"
                assert value.to_here() == 11
            with pytest.raises(PluribusError, match="use to_here"):
                counter.local_value()
            with pytest.raises(AttributeError, match="only public methods"):
                counter.rpc_sync()._secret()
            with pytest.raises(rpc.RemoteError, match="has no method 'nothing'"):
                counter.rpc_sync().nothing()
        with rpc.remote("w1", c.array_example) as array:
            np.testing.assert_array_equal(array.to_here(), c.array_example())
            with pytest.raises(rpc.RemoteError, match="instances of exposed classes"):
                array.rpc_sync().tofile("/tmp/x")  # a method of a value that is no exposed class
        with rpc.remote("w1", c.fail, args=("made badly",)) as broken:
            with pytest.raises(rpc.RemoteError, match="made badly"):
                broken.to_here()
        # a value made on this worker by remote() can be passed on at once
        with rpc.remote("w0", c.Counter, args=(7,)) as local:
            assert rpc.rpc_sync("w1", c.pass_on, args=(local, "w1")) == 1
            rpc.rpc_sync("w1", c.drop_kept)
            assert local.local_value().get() == 7
        mine = rpc.RRef(np.arange(4))
        assert mine.is_owner() and mine.local_value() is mine.to_here()
        doubled = rpc.rpc_sync("w1", c.to_here_of, args=(mine,))
        mine.release()
        return doubled

    np.testing.assert_array_equal(run_threads(2, main)[0], np.arange(4))


def test_shutdown_finishes_calls_in_flight():
    def main(rank):
        if rank == 0:
            futures = [rpc.rpc_async("w1", c.sleep, args=(0.3,)) for _ in range(4)]
            return futures
        return None

    futures = run_threads(2, main)[0]  # run_threads calls shutdown right after main
    assert [f.wait(0) for f in futures] == [0.3] * 4


def test_a_message_larger_than_the_callee_accepts_is_refused_at_the_caller():
    def main(rank):
        if rank != 0:
            return None
        with pytest.raises(ValueError) as refused:
            rpc.rpc_sync("w1", c.scale, args=(np.zeros(1024), 2.0))
        return str(refused.value), rpc.rpc_sync("w1", c.scale, args=(np.ones(8), 2.0)).sum()

    message, after = run_threads(2, main, max_message_bytes=4096)[0]
    assert "8192 bytes of arrays, more than worker 'w1' accepts (4096" in message
    assert after == 16.0


def test_a_dead_worker_fails_pending_calls_at_once():
    """A worker whose transport vanishes (as when its process dies) fails the calls pending
    on it with a PeerError naming it, long before their timeout."""

    def main(rank):
        if rank == 1:
            from pluribus.rpc.api import current_agent

            agent = current_agent()
            deadline = time.monotonic() + 10
            while not agent._connections and time.monotonic() < deadline:
                time.sleep(0.01)  # until w0's call has come in
            time.sleep(0.2)
            for connection in list(agent._connections):  # vanish without a goodbye
                connection.sock.shutdown(2)
            return None
        future = rpc.rpc_async("w1", c.sleep, args=(1.5,), timeout=30)
        start = time.monotonic()
        with pytest.raises(PeerError, match="worker 'w1' \\(rank 1\\) died"):
            future.wait()
        return time.monotonic() - start

    assert run_threads(2, main)[0] < 2.0


@pytest.mark.parametrize("shared_memory", [True, False])  # segments, or the socket itself
def test_large_arrays_both_ways_after_a_timed_out_call_do_not_block_the_connection(shared_memory):
    """32 MiB each way: a reply being written while the next request is must not deadlock,
    whether the arrays travel in segments or through the (local, Unix) socket."""
    big = np.arange(4 * 2**20, dtype=np.float64)

    def main(rank):
        if rank != 0:
            return None
        with pytest.raises(DistTimeoutError):
            rpc.rpc_sync("w1", c.echo_after, args=(0.3, big), timeout=0.1)
        futures = [rpc.rpc_async("w1", c.scale, args=(big, 2.0)) for _ in range(2)]
        back = rpc.rpc_sync("w1", c.scale, args=(big, 3.0), timeout=30)
        return back, [f.wait(30) for f in futures]

    back, others = run_threads(2, main, shared_memory=shared_memory)[0]
    np.testing.assert_array_equal(back, big * 3.0)
    for other in others:
        np.testing.assert_array_equal(other, big * 2.0)


def test_shutdown_returns_within_its_timeout_when_a_peer_never_shuts_down():
    store = c.HashStore()
    took = {}

    def body(rank):
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, store=store, timeout=20)
        if rank == 0:
            start = time.monotonic()
            rpc.shutdown(timeout=0.5)
            took[0] = time.monotonic() - start
        else:
            time.sleep(1.5)  # still working when w0 leaves
            start = time.monotonic()
            rpc.shutdown(timeout=10)
            took[1] = time.monotonic() - start

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert took[0] < 1.2
    assert took[1] < 2.0  # w0 is gone: nobody left to wait for


@pytest.mark.parametrize("scheme", ["file", "tcp"])
def test_init_method_file_and_tcp_rendezvous(tmp_path, scheme):
    """init_rpc finds the job the way init_process_group does (here: file:// and tcp://)."""
    import socket

    if scheme == "file":
        url = f"file://{tmp_path / 'store'}"
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            url = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    results, errors = {}, {}

    def body(rank):
        try:
            me = rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, init_method=url, timeout=20)
            try:
                if rank == 0:
                    results[0] = (me, rpc.rpc_sync("w1", c.add, args=(2, 3)))
            finally:
                rpc.shutdown(timeout=20)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not errors, errors
    assert results[0] == (rpc.WorkerInfo("w0", 0), 5)
