"""The public API around the collectives: initialisation and rendezvous, default and sub-groups,
device dispatch for hybrid groups, host staging, and the errors a user meets first."""

from __future__ import annotations

import threading

import numpy as np
import pluribus as pb
import pytest
from pluribus.distributed import _parse_backend
from pluribus.testing import RanksFailed, run_ranks


def test_collective_before_init_says_what_to_do():
    assert not pb.is_initialized()
    with pytest.raises(pb.NotInitializedError, match="init_process_group"):
        pb.all_reduce(np.ones(3))
    with pytest.raises(pb.NotInitializedError):
        pb.get_rank()


def _threads_world(n, init):
    """Run ``init(rank)`` then a small all_reduce on n threads; return each rank's result."""
    results, errors = [None] * n, []

    def main(rank):
        try:
            init(rank)
            x = np.array([rank + 1.0])
            pb.all_reduce(x)
            results[rank] = (pb.get_rank(), pb.get_world_size(), float(x[0]))
        except BaseException as exc:
            errors.append(exc)
        finally:
            pb.destroy_process_group()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


def test_init_with_tcp_url():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _threads_world(
        3,
        lambda r: pb.init_process_group(
            "threads", f"tcp://127.0.0.1:{port}", rank=r, world_size=3, timeout=20
        ),
    )
    assert res == [(r, 3, 6.0) for r in range(3)]


def test_init_with_file_url(tmp_path):
    url = f"file://{tmp_path}/rendezvous"
    res = _threads_world(
        2, lambda r: pb.init_process_group("threads", url, rank=r, world_size=2, timeout=20)
    )
    assert res == [(0, 2, 3.0), (1, 2, 3.0)]


def test_env_init_needs_rank_and_port(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE"):
        pb.init_process_group("threads")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        pb.init_process_group("threads")
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="outside the world"):
        pb.init_process_group("threads", "tcp://127.0.0.1:1")
    assert not pb.is_initialized()


def test_env_init_single_process(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    group = pb.init_process_group("threads", timeout=10)
    try:
        assert (pb.get_rank(), pb.get_world_size(), pb.get_backend()) == (0, 1, "threads")
        assert group is pb.get_default_group()
        x = np.arange(4.0)
        pb.all_reduce(x, pb.ReduceOp.AVG)
        assert (x == np.arange(4.0)).all()
    finally:
        pb.destroy_process_group()
    assert not pb.is_initialized()


def test_backend_strings():
    assert _parse_backend("threads") == {"cpu": "threads"}
    assert _parse_backend("cpu:threads,cuda:threads") == {"cpu": "threads", "cuda": "threads"}
    with pytest.raises(ValueError, match="cpu:name,cuda:name"):
        _parse_backend("tpu:threads")
    with pytest.raises(pb.BackendUnavailableError, match=r'pip install "pluribus\[mpi\]"'):
        _parse_backend("mpi") if not pb.is_mpi_available() else (_ for _ in ()).throw(
            pb.BackendUnavailableError('pip install "pluribus[mpi]"')
        )


class CupyFlags:
    """cupy's ``ndarray.flags``: contiguity and ownership, and no ``writeable`` at all."""

    def __init__(self, host):
        self.c_contiguous = host.flags.c_contiguous
        self.f_contiguous = host.flags.f_contiguous
        self.owndata = host.flags.owndata


class FakeCudaArray:
    """Stands in for a cupy array: its type's module starts with "cupy", get()/set() copy."""

    __module__ = "cupy._core.core"

    def __init__(self, host):
        self.host = np.ascontiguousarray(host)
        self.dtype, self.shape, self.size = self.host.dtype, self.host.shape, self.host.size
        self.flags = CupyFlags(self.host)
        self.copies = 0

    def get(self):
        self.copies += 1
        return self.host.copy()

    def set(self, host):
        self.copies += 1
        self.host[...] = host

    def reshape(self, *shape):
        return FakeCudaArray(self.host.reshape(*shape))


def _gpu_refused():
    with pytest.raises(TypeError, match="PLURIBUS_GPU_STAGING=1") as info:
        pb.all_reduce(FakeCudaArray(np.ones(3)))
    assert "cpu:gloo,cuda:nccl" in str(info.value)
    assert f"rank {pb.get_rank()}" in str(info.value)


def test_gpu_array_on_cpu_backend_is_refused():
    run_ranks(_gpu_refused, 2)


def _gpu_staged():
    x = FakeCudaArray(np.full(5, pb.get_rank() + 1.0))
    pb.all_reduce(x)
    assert (x.host == 3).all() and x.copies == 2  # one copy to host, one back
    pb.all_reduce(x)  # the second call takes the checked fast path
    assert (x.host == 6).all()
    pb.broadcast(x, src=0)
    assert (x.host == 6).all()


def test_gpu_staging_copies_through_host(monkeypatch):
    monkeypatch.setenv("PLURIBUS_GPU_STAGING", "1")
    run_ranks(_gpu_staged, 2)


def _hybrid_dispatch():
    group = pb.get_default_group()
    assert group.backend_for(np.ones(1)) is group.backends["cpu"]
    assert group.backend_for(FakeCudaArray(np.ones(1))) is group.backends["cuda"]
    x = np.array([pb.get_rank() + 1.0])
    pb.all_reduce(x)
    assert x[0] == 3


def test_hybrid_group_dispatches_by_device():
    run_ranks(_hybrid_dispatch, 2, backend="cpu:threads,cuda:threads")


def _raise_on_rank_one():
    if pb.get_rank() == 1:
        raise KeyError("deliberate")
    pb.all_reduce(np.ones(2))


def test_a_failing_rank_fails_its_peers_fast():
    import time

    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raise_on_rank_one, 3, timeout=30)
    kinds = info.value.kinds()
    assert kinds[1] == "KeyError" and kinds[0] == kinds[2] == "PeerError"
    assert time.monotonic() - start < 10


def _nested_groups():
    rank = pb.get_rank()
    first_three = pb.new_group([0, 1, 2])
    if rank == 3:
        assert first_three is pb.NON_GROUP_MEMBER
        return
    x = np.array([float(rank)])
    pb.all_reduce(x, group=first_three)
    assert x[0] == 3
    work = [pb.all_reduce(np.ones(10), group=first_three, async_op=True) for _ in range(3)]
    y = np.ones(1)
    pb.all_reduce(y)  # the world and the sub-group do not share a queue
    for w in work:
        w.wait()


def test_subgroup_and_world_interleave():
    # world ops only on members after the sub-group: rank 3 skips the world all_reduce too
    with pytest.raises(RanksFailed):
        run_ranks(_nested_groups, 4, timeout=5)
    run_ranks(_sub_only, 4)


def _sub_only():
    rank = pb.get_rank()
    g = pb.new_group([1, 3])
    if rank in (1, 3):
        x = np.array([float(rank)])
        pb.all_reduce(x, group=g)
        assert x[0] == 4
    x = np.ones(2)
    pb.all_reduce(x)
    assert (x == 4).all()


def _world_on_a_fresh_store(rank, n, store):
    pb.init_process_group("threads", rank=rank, world_size=n, store=store, timeout=10)
    try:
        x = np.ones(1)
        pb.all_reduce(x)
        return float(x[0])
    finally:
        pb.destroy_process_group()


@pytest.mark.timeout(60)
def test_threads_that_ran_a_world_before_meet_fresh_ones_on_a_fresh_store():
    """A default group started again keys a store that held one before under a prefix; one on a
    fresh store does not, whatever its thread ran before (here: two of four)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for n in (2, 4):
            store = pb.HashStore(timeout=10)
            results = list(pool.map(_world_on_a_fresh_store, range(n), [n] * n, [store] * n))
            assert results == [float(n)] * n


def _groups_in_another_order():
    """Rank 0 makes [0, 1] then [0, 2]; the others make them the other way round."""
    order = [[0, 1], [0, 2]] if pb.get_rank() == 0 else [[0, 2], [0, 1]]
    try:
        for ranks in order:
            pb.new_group(ranks, timeout=3)
    except (ValueError, pb.DistTimeoutError) as e:
        return str(e)


@pytest.mark.timeout(60)
def test_new_group_in_another_order_on_some_ranks_says_so():
    errors = run_ranks(_groups_in_another_order, 3, timeout=30)
    assert errors[2] == (
        "rank 2: new_group made group 'world.1' of ranks [0, 2] here and of ranks [0, 1] on "
        "rank 0; every rank must call new_group in the same order with the same ranks"
    )
    assert errors[0].startswith("rank 0: rank 1 did not make group 'world.1' of ranks [0, 1]")
    assert errors[1].startswith("rank 1: rank 0 did not make group 'world.2' of ranks [0, 1]")
    for error in errors[:2]:
        assert error.endswith(
            "every rank must call new_group in the same order with the same ranks"
        )


def test_work_handles():
    from pluribus.work import CompletedWork, FutureWork

    done = CompletedWork(5)
    assert done.wait() and done.is_completed() and done.result() == 5
    pending = FutureWork("op", default_timeout=0.1)
    assert not pending.is_completed()
    with pytest.raises(pb.DistTimeoutError, match="op did not complete"):
        pending.wait()
    seen = []
    pending.add_done_callback(lambda w: seen.append(w.result()))
    pending.set_result(7)
    assert seen == [7] and pending.wait()
    failed = FutureWork("bad")
    failed.set_exception(ValueError("x"))
    with pytest.raises(ValueError):
        failed.wait()
