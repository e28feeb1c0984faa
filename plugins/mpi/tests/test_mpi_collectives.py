"""The mpi backend's own behaviour under mpiexec: MPI requests behind async Works, buffers handed
to MPI in place (views of one buffer, separate arrays, aliasing), half floats, communicators for
sub-groups, timeouts that poll without spinning, and errors that name the rank.

Every test runs on every rank of the job (run_mpi_tests.sh: mpiexec -n 2, 3 and 4).
"""

from __future__ import annotations

import time

import numpy as np
import pluribus as pb
import pytest
from pluribus.arrays import bfloat16_dtype
from pluribus.errors import DistTimeoutError, PluribusError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]
ReduceOp = pb.ReduceOp


@pytest.fixture
def world(mpi_world):
    yield mpi_world
    pb.barrier()  # every test ends in step on every rank


def _mpi():
    from mpi4py import MPI

    return MPI


def test_world_is_a_private_duplicate_of_comm_world(world):
    from pluribus_mpi.backend import MPIBackend

    MPI = _mpi()
    backend = world.backends["cpu"]
    assert isinstance(backend, MPIBackend)
    assert (pb.get_rank(), pb.get_world_size()) == (
        MPI.COMM_WORLD.Get_rank(),
        MPI.COMM_WORLD.Get_size(),
    )
    assert MPI.Comm.Compare(backend.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


def test_async_operations_return_works_around_mpi_requests(world):
    from pluribus_mpi.work import MPIWork

    MPI = _mpi()
    rank, size = pb.get_rank(), pb.get_world_size()
    x = np.full(6, float(rank + 1))
    b = np.full(3, float(rank))
    red = np.full(4, float(rank + 1))
    gathered = np.zeros(2 * size)
    scattered = np.zeros(2)
    works = [
        pb.all_reduce(x, ReduceOp.AVG, async_op=True),
        pb.broadcast(b, size - 1, async_op=True),
        pb.reduce(red, 0, ReduceOp.MAX, async_op=True),
        pb.all_gather(gathered, np.full(2, float(rank)), async_op=True),
        pb.scatter(
            scattered,
            [np.full(2, float(r)) for r in range(size)] if rank == 0 else None,
            0,
            async_op=True,
        ),
        pb.barrier(async_op=True),
    ]
    for work in works:
        assert isinstance(work, MPIWork)
        assert isinstance(work.pending.request, MPI.Request)
    for work in reversed(works):
        assert work.wait(timeout=30)
        assert work.is_completed() and work.exception() is None
    assert (x == (size + 1) / 2).all()  # AVG is applied when the work completes
    assert (b == size - 1).all()
    if rank == 0:
        assert (red == size).all()
    else:
        assert (red == rank + 1).all()
    assert (gathered == np.repeat(np.arange(size, dtype=float), 2)).all()
    assert (scattered == rank).all()


def test_done_callbacks_run_when_the_work_completes(world):
    seen = []
    work = pb.all_reduce(np.ones(3), async_op=True)
    work.add_done_callback(lambda w: seen.append(w.exception()))
    work.wait(timeout=30)
    assert seen == [None]
    work.add_done_callback(lambda w: seen.append("late"))
    assert seen == [None, "late"]


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_half_floats_reduce_with_every_op(world, dtype_name):
    dtype = np.dtype(np.float16) if dtype_name == "float16" else bfloat16_dtype()
    if dtype is None:
        pytest.skip("ml_dtypes is not installed (pip install ml_dtypes)")
    rank, size = pb.get_rank(), pb.get_world_size()
    n = 100_003  # large enough that MPI reduces it in pieces
    base = (np.arange(n) % 5).astype(np.float32)
    for op, expected in (
        (ReduceOp.SUM, base * size + sum(range(size))),
        (ReduceOp.AVG, base + (size - 1) / 2),
        (ReduceOp.MIN, base),
        (ReduceOp.MAX, base + size - 1),
        (ReduceOp.PRODUCT, np.prod([base * 0 + (1 + r % 2) for r in range(size)], axis=0)),
    ):
        x = (
            (base + rank).astype(dtype)
            if op is not ReduceOp.PRODUCT
            else np.full(n, 1 + rank % 2, dtype=dtype)
        )
        pb.all_reduce(x, op)
        np.testing.assert_allclose(x.astype(np.float32), expected, rtol=1e-2, err_msg=str(op))
        y = (base + rank).astype(dtype)
        pb.reduce(y, size - 1, ReduceOp.MAX)
        if rank == size - 1:
            np.testing.assert_allclose(y.astype(np.float32), base + size - 1)


def test_integer_bitwise_and_bool_logical_ops(world):
    rank, size = pb.get_rank(), pb.get_world_size()
    bits = np.array([1 << rank, 0xFF, rank], dtype=np.int64)
    pb.all_reduce(bits, ReduceOp.BOR)
    assert bits[0] == (1 << size) - 1 and bits[1] == 0xFF
    flags = np.array([rank == 0, True, False, rank % 2 == 1])
    pb.all_reduce(flags, ReduceOp.BXOR)
    odd_ranks = size // 2
    assert list(flags) == [True, size % 2 == 1, False, odd_ranks % 2 == 1]
    flags = np.array([rank == 0, True])
    pb.all_reduce(flags, ReduceOp.MIN)  # logical and on bool
    assert list(flags) == [size == 1, True]


def test_empty_symmetric_is_a_plain_array_on_mpi(world):
    """MPI shares no user memory here: the core's default, an ordinary array, reduced as any."""
    rank, size = pb.get_rank(), pb.get_world_size()
    x = pb.empty_symmetric((2, 300_000), np.float32)
    assert type(x) is np.ndarray and x.flags.owndata and x.shape == (2, 300_000)
    x[...] = rank + 1
    pb.all_reduce(x)
    assert (x == size * (size + 1) / 2).all()


def test_all_gather_into_separate_arrays_and_uneven_sizes(world):
    rank, size = pb.get_rank(), pb.get_world_size()
    # separate arrays, allocated far apart, of different sizes per rank
    outputs = [np.full(r + 2, -1, dtype=np.int32) for r in range(size)]
    spacers = [np.zeros(1000) for _ in range(size)]  # noqa: F841  (keeps the arrays apart)
    pb.all_gather(outputs, np.full(rank + 2, rank, dtype=np.int32))
    for r in range(size):
        assert (outputs[r] == r).all()
    # in place: the input is this rank's block of the output (torch's usual pattern)
    out = np.zeros((size, 3))
    out[rank] = rank + 0.5
    pb.all_gather(out, out[rank])
    assert (out == (np.arange(size) + 0.5)[:, None]).all()
    if size > 1:
        # the input overlaps the output elsewhere: MPI forbids aliasing, the plugin copies it
        out = np.arange(size * 2, dtype=np.float64) + 100 * rank
        pb.all_gather(out, out[1:3])
        expected = np.concatenate([np.array([1.0, 2.0]) + 100 * r for r in range(size)])
        assert (out == expected).all()


def test_reduce_scatter_from_separate_blocks_and_into_its_input(world):
    rank, size = pb.get_rank(), pb.get_world_size()
    inputs = [np.full(r + 1, float(rank + r), dtype=np.float64) for r in range(size)]
    out = np.zeros(rank + 1)
    pb.reduce_scatter(out, inputs)
    assert (out == sum(range(size)) + size * rank).all()
    # output is a view of the input's own block
    full = np.arange(size * 4, dtype=np.float32) + rank
    pb.reduce_scatter(full[rank * 4 : (rank + 1) * 4], full, ReduceOp.MAX)
    assert (full[rank * 4 : (rank + 1) * 4] == np.arange(rank * 4, rank * 4 + 4) + size - 1).all()


def test_all_to_all_in_place_and_uneven(world):
    rank, size = pb.get_rank(), pb.get_world_size()
    buf = np.arange(size * 3, dtype=np.int64) + 1000 * rank
    pb.all_to_all_single(buf, buf)  # the same array in and out
    for src in range(size):
        assert (
            buf[src * 3 : (src + 1) * 3] == np.arange(rank * 3, rank * 3 + 3) + 1000 * src
        ).all()
    inputs = [np.full(d + rank + 1, rank * 10 + d, dtype=np.int16) for d in range(size)]
    outputs = [np.zeros(rank + s + 1, dtype=np.int16) for s in range(size)]
    work = pb.all_to_all(outputs, inputs, async_op=True)
    work.wait(timeout=30)
    for s in range(size):
        assert (outputs[s] == s * 10 + rank).all()


def test_gather_and_scatter_in_place_at_the_root(world):
    rank, size = pb.get_rank(), pb.get_world_size()
    root = size - 1
    outs = [np.zeros(4) for _ in range(size)] if rank == root else None
    mine = outs[root] if rank == root else np.zeros(4)
    mine[...] = rank
    pb.gather(mine, outs, dst=root)
    if rank == root:
        assert [float(o[0]) for o in outs] == [float(r) for r in range(size)]
    pieces = [np.full(r + 1, float(r)) for r in range(size)] if rank == root else None
    target = pieces[root] if rank == root else np.zeros(rank + 1)
    pb.scatter(target, pieces, src=root)
    assert (target == rank).all() and target.size == rank + 1


def test_send_recv_tags_and_size_mismatch(world):
    rank, size = pb.get_rank(), pb.get_world_size()
    if size == 1:
        pytest.skip("needs two ranks")
    right, left = (rank + 1) % size, (rank - 1) % size
    big_tag = (1 << 24) - 1  # the largest user tag
    w = pb.isend(np.full(3, float(rank)), right, tag=big_tag)
    got = np.zeros(3)
    pb.recv(got, left, tag=big_tag)
    w.wait(timeout=30)
    assert (got == left).all()
    # fewer bytes than the receive array holds
    w = pb.isend(np.ones(2), right, tag=5)
    with pytest.raises(ValueError, match=rf"rank {rank}: rank {left} sent 16 bytes .* expected 32"):
        pb.recv(np.zeros(4), left, tag=5)
    w.wait(timeout=30)
    # more bytes than it holds
    w = pb.isend(np.ones(4), right, tag=6)
    with pytest.raises(ValueError, match=rf"rank {rank}: .*larger than the array"):
        pb.recv(np.zeros(2), left, tag=6)
    w.wait(timeout=30)


def test_wait_timeout_polls_without_spinning_then_completes(world):
    rank, size = pb.get_rank(), pb.get_world_size()
    if size == 1:
        pytest.skip("needs two ranks")
    right, left = (rank + 1) % size, (rank - 1) % size
    late = np.zeros(2)
    work = pb.irecv(late, left, tag=42)
    cpu, wall = time.process_time(), time.monotonic()
    with pytest.raises(DistTimeoutError, match=rf"rank {rank}: recv\(shape=\(2,\).* within 1.0s"):
        work.wait(timeout=1.0)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    assert 0.9 < wall < 5
    assert cpu < 0.5 * wall, f"waiting used {cpu:.2f}s of CPU in {wall:.2f}s"
    assert not work.is_completed()
    pb.barrier()
    pb.send(np.full(2, 7.0), right, tag=42)
    work.wait(timeout=30)
    assert (late == 7).all()


def test_sub_groups_are_mpi_communicators_freed_on_destroy(world):
    from pluribus_mpi.backend import MPIBackend

    MPI = _mpi()
    rank, size = pb.get_rank(), pb.get_world_size()
    tail = pb.new_group(list(range(1, size))) if size > 1 else None
    everyone = pb.new_group()
    if rank >= 1:
        backend = tail.backends["cpu"]
        assert isinstance(backend, MPIBackend)
        assert backend.comm.Get_size() == size - 1 and backend.comm.Get_rank() == rank - 1
        assert MPI.Comm.Compare(backend.comm, MPI.COMM_WORLD) == MPI.UNEQUAL
        x = np.full(5, float(rank))
        work = pb.all_reduce(x, group=tail, async_op=True)
        y = np.full(2, float(rank))
        pb.all_reduce(y, group=everyone)  # another communicator meanwhile
        work.wait(timeout=30)
        assert (x == sum(range(1, size))).all()
        pb.destroy_process_group(tail)
        assert backend.comm == MPI.COMM_NULL
        with pytest.raises(PluribusError, match="destroyed"):
            pb.all_reduce(np.ones(1), group=tail)
    else:
        assert size == 1 or tail is pb.NON_GROUP_MEMBER
        y = np.full(2, float(rank))
        pb.all_reduce(y, group=everyone)
    assert (y == sum(range(size))).all()
    pb.destroy_process_group(everyone)


def test_ops_on_several_groups_complete_in_issue_order(world):
    rank, size = pb.get_rank(), pb.get_world_size()
    sub = pb.new_group(list(range(size)))
    arrays, works = [], []
    for i in range(30):
        group = sub if i % 3 == 0 else None
        a = np.full(1 + 500 * (i % 4), float(i + rank))
        arrays.append(a)
        if i % 5 == 4:
            pb.all_reduce(a, group=group)  # a blocking one among the async ones
        else:
            works.append(pb.all_reduce(a, group=group, async_op=True))
    for w in reversed(works):
        w.wait(timeout=30)
    for i, a in enumerate(arrays):
        assert (a == sum(i + r for r in range(size))).all(), f"operation {i}"
    pb.destroy_process_group(sub)


def test_abort_stops_waits_on_this_rank(world):
    rank, size = pb.get_rank(), pb.get_world_size()
    sub = pb.new_group(list(range(size)))
    backend = sub.backends["cpu"]
    pending = backend.start("recv", (np.zeros(1), rank, 77))  # never sent
    backend.abort("a peer failed in a test")
    start = time.monotonic()
    with pytest.raises(PluribusError, match="a peer failed in a test"):
        pending.wait(timeout=30)
    assert time.monotonic() - start < 5
    with pytest.raises(PluribusError, match="stopped"):
        pb.all_reduce(np.ones(1), group=sub)
    pending.pending.request.Cancel()
    pending.pending.request.Wait()
    pb.destroy_process_group(sub)


@pytest.mark.gpu
def test_cupy_arrays_use_host_staging_or_are_refused(world, monkeypatch):
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no CUDA device: {exc}")
    rank, size = pb.get_rank(), pb.get_world_size()
    backend = world.backends["cpu"]
    x = cupy.full(8, rank + 1.0)
    if not backend.cuda_aware:
        with pytest.raises(TypeError, match="PLURIBUS_GPU_STAGING"):
            pb.all_reduce(x)
        monkeypatch.setattr(world, "gpu_staging", True)
    pb.all_reduce(x)
    assert float(x[0]) == size * (size + 1) / 2
    work = pb.broadcast(x, 0, async_op=True)
    work.wait(timeout=30)
    assert float(x[0]) == size * (size + 1) / 2


def test_a_start_up_problem_on_one_rank_raises_on_every_rank_without_pickle(world):
    from pluribus_mpi.failure import raise_if_any

    MPI = _mpi()

    class NoPickle(MPI.Intracomm):
        def allgather(self, sendobj):  # mpi4py's lowercase collectives pickle
            raise AssertionError("the start-up check used mpi4py's pickled allgather")

    duplicate = MPI.COMM_WORLD.Dup()
    comm = NoPickle(duplicate)
    try:
        raise_if_any(comm, None, "start")  # no problem anywhere: nothing raised
        rank = comm.Get_rank()
        problem = "rank 1: MASTER_PORT différent" if rank == 1 else None
        with pytest.raises(PluribusError) as raised:
            raise_if_any(comm, problem, "start the mpi backend")
        if rank == 1:
            assert str(raised.value) == problem
        else:
            assert f"rank {rank}: could not start the mpi backend" in str(raised.value)
            assert "MASTER_PORT différent" in str(raised.value)
    finally:
        duplicate.Free()
