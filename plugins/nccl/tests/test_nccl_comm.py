"""Communicator set-up (id exchange through the store, device choice), stream ordering, and
failures (timeout -> abort, asynchronous NCCL errors), on the CPU stand-in for cupy/NCCL."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from nccl_fakes import FakeNccl, FakeRuntime, device_array, run_threads
from pluribus import BackendContext, HashStore, PrefixStore, ReduceOp
from pluribus.errors import DistTimeoutError, PeerError, PluribusError
from pluribus_nccl.backend import (
    UNIQUE_ID_KEY,
    NcclBackend,
    choose_device,
    create_backend,
    encode_unique_id,
    unique_id_as_tuple,
)

pytestmark = pytest.mark.timeout(60)


def _ctx(store, rank, size, timeout=10.0, name="world", **options) -> BackendContext:
    return BackendContext(
        rank=rank,
        size=size,
        store=PrefixStore(f"{name}/nccl", store),
        timeout=timeout,
        group_name=name,
        device="cuda",
        options=options,
    )


def _world(size: int, runtime: FakeRuntime, timeout: float = 10.0) -> list[NcclBackend]:
    store = HashStore()
    return run_threads(
        size, lambda r: create_backend(_ctx(store, r, size, timeout), runtime, device_id=0)
    )


@pytest.mark.parametrize("id_form", ["bytes", "tuple"])
def test_rank0_makes_the_id_and_every_rank_joins_with_it(id_form):
    nccl = FakeNccl(id_form=id_form)
    runtime = FakeRuntime(nccl)
    store = HashStore()
    backends = run_threads(3, lambda r: create_backend(_ctx(store, r, 3), runtime, device_id=0))
    assert nccl.unique_ids_made == 1, "only rank 0 may call get_unique_id"
    keys = {b.comm.key for b in backends}
    assert len(keys) == 1, "ranks joined different communicators"
    assert [b.comm.rank for b in backends] == [0, 1, 2]
    assert all(b.comm.size == 3 for b in backends)
    published = store.get(f"world/nccl/{UNIQUE_ID_KEY}")
    assert bytes(published) == next(iter(keys))


def test_unique_id_round_trips_both_forms():
    raw = bytes(range(256))[:128]
    signed = unique_id_as_tuple(raw)
    assert all(-128 <= v <= 127 for v in signed)
    assert encode_unique_id(signed) == raw
    assert encode_unique_id(raw) == raw
    with pytest.raises(ValueError, match="128 bytes"):
        encode_unique_id(b"short")


def test_a_missing_rank0_times_out_with_a_clear_error():
    runtime = FakeRuntime()
    store = HashStore()
    with pytest.raises(DistTimeoutError, match="rank 0 of group 'world' did not publish"):
        create_backend(_ctx(store, 1, 2, timeout=0.3), runtime, device_id=0)


def test_a_rank_that_never_joins_bounds_communicator_creation():
    runtime = FakeRuntime(FakeNccl(wait=3.0))
    store = HashStore()
    start = time.monotonic()
    with pytest.raises(DistTimeoutError, match="did not form within"):
        create_backend(_ctx(store, 0, 2, timeout=0.3), runtime, device_id=0)
    assert time.monotonic() - start < 2.5


def test_device_choice(monkeypatch):
    runtime = FakeRuntime(devices=4)
    store = HashStore()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert choose_device(_ctx(store, 6, 8), runtime) == 2  # rank modulo the GPU count
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert choose_device(_ctx(store, 0, 8), runtime) == 3
    assert choose_device(_ctx(store, 0, 8, device_id=1), runtime) == 1  # the option wins
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(PluribusError, match="asks for GPU 5 but 4 GPU"):
        choose_device(_ctx(store, 0, 8), runtime)


def test_arrays_on_another_gpu_are_refused():
    runtime = FakeRuntime()
    (backend,) = _world(1, runtime)
    runtime.local.device = 1  # arrays made by this thread now live on cuda:1
    with pytest.raises(ValueError, match="cuda:1.*bound to cuda:0"):
        backend.all_reduce_async(device_array([1.0]), ReduceOp.SUM)


def test_work_is_ordered_after_the_callers_stream_and_before_its_later_work():
    runtime = FakeRuntime()
    (backend,) = _world(1, runtime)
    caller = runtime.current_stream()
    work = backend.all_reduce_async(device_array([1.0, 2.0]), ReduceOp.SUM)
    ready = backend.stream.waited_on[-1]
    assert ready.recorded_on is caller, "the comm stream must wait for the caller's stream"
    assert work.event.recorded_on is backend.stream
    assert work not in caller.waited_on and work.event not in caller.waited_on
    backend.complete(work)  # what a synchronous call does
    assert caller.waited_on[-1] is work.event
    assert work.wait() and work.is_completed()


def test_a_work_past_its_timeout_aborts_the_communicator_and_raises():
    runtime = FakeRuntime()
    (backend,) = _world(1, runtime)
    runtime.events_hang = True
    work = backend.all_reduce_async(device_array([1.0]), ReduceOp.SUM)
    start = time.monotonic()
    with pytest.raises(DistTimeoutError, match="did not finish within 0.2s.*aborted"):
        work.wait(timeout=0.2)
    assert 0.15 < time.monotonic() - start < 2.0
    assert backend.comm.aborted
    assert isinstance(work.exception(), DistTimeoutError) and work.is_completed()
    with pytest.raises(DistTimeoutError, match="earlier NCCL operation failed"):
        backend.broadcast_async(device_array([1.0]), 0)
    with pytest.raises(PluribusError):
        work.wait()  # waiting again raises again, never silently succeeds


def test_the_watchdog_aborts_a_synchronous_call_that_hangs():
    runtime = FakeRuntime()
    (backend,) = _world(1, runtime, timeout=0.3)
    runtime.events_hang = True
    work = backend.all_reduce_async(device_array([1.0]), ReduceOp.SUM)
    backend.complete(work)  # returns at once: the host does not block on the GPU
    deadline = time.monotonic() + 5
    while not backend.comm.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.comm.aborted, "the watchdog did not abort the hung communicator"
    with pytest.raises(DistTimeoutError):
        backend.all_reduce_async(device_array([1.0]), ReduceOp.SUM)


def test_an_enqueue_blocked_inside_nccl_is_aborted_by_the_watchdog():
    runtime = FakeRuntime(FakeNccl(wait=20.0))
    backends = _world(2, runtime, timeout=0.3)
    start = time.monotonic()
    # Only rank 0 calls: the stand-in blocks the host inside the call, as ncclGroupEnd does
    # while it connects to a peer that never answers.
    with pytest.raises(DistTimeoutError, match="blocked while being enqueued"):
        backends[0].all_reduce_async(device_array([1.0]), ReduceOp.SUM)
    assert time.monotonic() - start < 5.0
    assert backends[0].comm.aborted and not backends[1].comm.aborted


def test_blocking_wait_raises_the_timeout_on_the_synchronous_call():
    runtime = FakeRuntime()
    store = HashStore()
    backend = create_backend(
        _ctx(store, 0, 1, timeout=0.2, nccl_blocking_wait=True), runtime, device_id=0
    )
    assert backend.blocking_wait
    runtime.events_hang = True
    work = backend.all_reduce_async(device_array([1.0]), ReduceOp.SUM)
    with pytest.raises(DistTimeoutError):
        backend.complete(work)
    assert backend.comm.aborted


def test_an_asynchronous_nccl_error_is_raised_not_swallowed():
    runtime = FakeRuntime()
    (backend,) = _world(1, runtime)
    runtime.events_hang = True
    work = backend.all_reduce_async(device_array([1.0]), ReduceOp.SUM)
    backend.comm.async_error = "NCCL_ERROR_REMOTE_ERROR: remote process exited"
    start = time.monotonic()
    with pytest.raises(PeerError, match="asynchronous error.*REMOTE_ERROR"):
        work.wait(timeout=30)
    assert time.monotonic() - start < 2.0, "an async error must not wait for the timeout"
    assert backend.comm.aborted


def _asynchronous_error_while_a_work_hangs(runtime: FakeRuntime) -> NcclBackend:
    """A backend with one work that never finishes and then an asynchronous NCCL error;
    returned once its watchdog has seen the error, or after 5 s."""
    (backend,) = _world(1, runtime)
    runtime.events_hang = True
    work = backend.all_reduce_async(device_array([1.0]), ReduceOp.SUM)
    backend.complete(work)
    backend.comm.async_error = "NCCL_ERROR_SYSTEM_ERROR: connection reset"
    deadline = time.monotonic() + 5
    while backend.error is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return backend


def test_the_watchdog_reports_an_asynchronous_error_on_the_next_call():
    backend = _asynchronous_error_while_a_work_hangs(FakeRuntime())
    with pytest.raises(PeerError, match="connection reset"):
        backend.all_reduce_async(device_array([1.0]), ReduceOp.SUM)


class _SlowDoneEvent(FakeRuntime):
    """A runtime whose event after each NCCL call (the ``done`` one) takes 0.3 s to make: the
    watchdog, woken by the enqueue, finds nothing pending and nothing enqueuing meanwhile and
    goes to sleep before the work is added."""

    def __init__(self):
        super().__init__()
        self.made = 0

    def new_event(self):
        self.made += 1
        if self.made % 2 == 0:  # the second of each enqueue: after the call, before the work
            time.sleep(0.3)
        return super().new_event()


def test_the_watchdog_watches_a_work_added_while_it_slept():
    backend = _asynchronous_error_while_a_work_hangs(_SlowDoneEvent())
    assert isinstance(backend.error, PeerError), "the watchdog never looked at the work"


def test_abort_stops_the_communicator():
    runtime = FakeRuntime()
    (backend,) = _world(1, runtime)
    backend.abort("peer 3 died")
    assert backend.comm.aborted
    with pytest.raises(PluribusError, match="peer 3 died"):
        backend.barrier()


def test_close_destroys_the_communicator_once():
    runtime = FakeRuntime()
    (backend,) = _world(1, runtime)
    backend.barrier()
    comm = backend.comm
    backend.close()
    backend.close()
    assert comm.destroyed and not comm.aborted
    with pytest.raises(PluribusError, match="destroyed"):
        backend.barrier()


def test_subgroups_get_their_own_communicator():
    nccl = FakeNccl()
    runtime = FakeRuntime(nccl)
    store = HashStore()
    parents = run_threads(3, lambda r: create_backend(_ctx(store, r, 3), runtime, device_id=0))
    members = [0, 2]

    def make_sub(r: int):
        if r not in members:
            return None
        return parents[r].new_subgroup(members, _ctx(store, members.index(r), 2, name="world.1"))

    subs = run_threads(3, make_sub)
    assert subs[1] is None
    assert subs[0].comm.key == subs[2].comm.key != parents[0].comm.key
    assert (subs[0].rank, subs[2].rank, subs[0].size) == (0, 1, 2)
    values = {0: device_array([1.0, 2.0]), 2: device_array([10.0, 20.0])}
    run_threads(3, lambda r: subs[r].all_reduce(values[r], ReduceOp.SUM) if subs[r] else None)
    for r in members:
        np.testing.assert_array_equal(values[r], [11.0, 22.0])
    for r in members:
        subs[r].close()
    assert subs[0].comm is None and parents[0].comm is not None


def test_operations_from_two_threads_do_not_interleave_their_enqueueing():
    runtime = FakeRuntime()
    (backend,) = _world(1, runtime)
    arrays = [device_array(np.arange(4, dtype=np.float32)) for _ in range(20)]

    def hammer(start: int) -> None:
        for a in arrays[start::2]:
            backend.all_reduce_async(a, ReduceOp.SUM).wait()

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len([c for c in backend.comm.calls if c[0] == "allReduce"]) == 20


def test_each_rank_binds_its_own_gpu_and_makes_it_current(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    runtime = FakeRuntime(devices=2)
    store = HashStore()

    def rank_main(r: int):
        backend = create_backend(_ctx(store, r, 2), runtime)
        x = device_array([float(r + 1)])
        backend.all_reduce(x, ReduceOp.SUM)  # accepted: allocated on the rank's current GPU
        return backend.device_id, runtime.local.device, float(x[0])

    assert run_threads(2, rank_main) == [(0, 0, 3.0), (1, 1, 3.0)]


def test_two_ranks_on_one_gpu_are_refused_on_every_rank_before_nccl_starts(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    runtime = FakeRuntime(devices=2)
    store = HashStore()

    def rank_main(r: int):
        device = 1 if r == 1 else 0  # ranks 0 and 2 both pick GPU 0
        try:
            create_backend(_ctx(store, r, 3, device_id=device), runtime)
        except PluribusError as exc:
            return str(exc)
        return "created"

    messages = run_threads(3, rank_main)
    for r, message in enumerate(messages):
        assert message.startswith(f"rank {r}: group 'world' cannot use NCCL"), message
        assert "ranks 0, 2 all use GPU 0 (testhost 0000:00:00.0)" in message
        assert "ucc" in message and "device_id" in message
    # refused before rank 0 made an NCCL id: no rank ever reached ncclCommInitRank
    assert not PrefixStore("world/nccl", store).check([UNIQUE_ID_KEY])
