"""NCCL on real GPUs: every collective against numpy, stream ordering, the hybrid group, and a
hung collective aborting the communicator.

One rank per GPU (NCCL refuses two ranks on one GPU): a 1-rank world always runs when a GPU is
visible, the multi-process tests when two or more are. Ranks are spawned processes; each binds
GPU ``rank`` (rank modulo the GPU count). Run them with ``plugins/nccl/tests/run_gpu_checks.sh``.
"""

from __future__ import annotations

import numpy as np
import pluribus as dist
import pytest
from pluribus import ReduceOp
from pluribus.testing import run_ranks
from pluribus.testing.checks import expected_reduction, rank_input

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

#: Element counts every reduction is checked at (the CPU run of these checks uses fewer).
SIZES = (0, 1, 1000, (1 << 20) + 3)


def _gpu_count() -> int:
    status = dist.availability("nccl")
    return int(status.details.get("devices", 0)) if status.ok else 0


def _skip_reason() -> str:
    status = dist.availability("nccl")
    return f"NCCL is not available here: {status.reason} ({status.remedy})"


needs_gpu = pytest.mark.skipif(_gpu_count() < 1, reason=_skip_reason())
needs_two_gpus = pytest.mark.skipif(
    _gpu_count() < 2, reason="needs 2 or more visible GPUs (one NCCL rank per GPU)"
)


def _hybrid_backend(world_size: int) -> str | None:
    if dist.is_gloo_available():
        return "cpu:gloo,cuda:nccl"
    if world_size == 1:
        return "cpu:threads,cuda:nccl"  # a 1-rank world needs no process transport
    return None


# -- what every rank runs (module level: spawned processes import it) -----------------------------


def _close(actual, expected, what: str) -> None:
    actual = actual.get() if hasattr(actual, "get") else actual
    tol = 2e-2 if np.dtype(expected.dtype).itemsize <= 2 else 1e-6
    if np.dtype(expected.dtype).kind == "f":
        np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


def check_every_collective() -> dict:
    import cupy

    rank, size = dist.get_rank(), dist.get_world_size()
    backend = dist.get_default_group().backends["cuda"]
    assert backend.name == "nccl" and cupy.cuda.Device().id == backend.device_id
    for n in SIZES:
        for dtype in (
            np.float32,
            np.float64,
            np.float16,
            np.int32,
            np.int64,
            np.int8,
            np.uint8,
            np.int16,
            np.bool_,
        ):
            ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
            if np.dtype(dtype).kind == "f":
                ops.append(ReduceOp.AVG)
            for op in ops:
                x = cupy.asarray(rank_input(rank, n, dtype, op))
                dist.all_reduce(x, op=op)
                _close(x, expected_reduction(size, n, dtype, op), f"all_reduce {n} {dtype} {op}")
    # reduce, broadcast
    root = size - 1
    x = cupy.asarray(rank_input(rank, 1001, np.float32))
    dist.reduce(x, dst=root, op=ReduceOp.SUM)
    want = (
        expected_reduction(size, 1001, np.float32, ReduceOp.SUM)
        if rank == root
        else rank_input(rank, 1001, np.float32)
    )
    _close(x, want, "reduce")
    x = cupy.asarray(rank_input(rank, 999, np.int64))
    dist.broadcast(x, src=root)
    _close(x, rank_input(root, 999, np.int64), "broadcast")
    # all_gather: into one tensor, into separate arrays, uneven
    mine = cupy.asarray(rank_input(rank, 513, np.float32))
    flat = cupy.empty(513 * size, np.float32)
    dist.all_gather_into_tensor(flat, mine)
    _close(
        flat, np.concatenate([rank_input(r, 513, np.float32) for r in range(size)]), "all_gather"
    )
    outs = [cupy.empty(r + 2, np.int32) for r in range(size)]
    dist.all_gather(outs, cupy.asarray(rank_input(rank, rank + 2, np.int32)))
    for r in range(size):
        _close(outs[r], rank_input(r, r + 2, np.int32), f"uneven all_gather from {r}")
    # reduce_scatter: even tensor, uneven list, AVG
    full = cupy.asarray(rank_input(rank, 64 * size, np.float32))
    out = cupy.empty(64, np.float32)
    dist.reduce_scatter_tensor(out, full)
    total = expected_reduction(size, 64 * size, np.float32, ReduceOp.SUM)
    _close(out, total[rank * 64 : (rank + 1) * 64], "reduce_scatter")
    blocks = [cupy.asarray(rank_input(rank, i + 1, np.float64)) for i in range(size)]
    out = cupy.empty(rank + 1, np.float64)
    dist.reduce_scatter(out, blocks, op=ReduceOp.AVG)
    _close(
        out, expected_reduction(size, rank + 1, np.float64, ReduceOp.AVG), "uneven reduce_scatter"
    )
    # all_to_all (uneven), gather, scatter
    inputs = [cupy.full(j + 1, 10 * rank + j, np.int32) for j in range(size)]
    outputs = [cupy.empty(rank + 1, np.int32) for _ in range(size)]
    dist.all_to_all(outputs, inputs)
    for j in range(size):
        _close(outputs[j], np.full(rank + 1, 10 * j + rank, np.int32), f"all_to_all from {j}")
    gathered = [cupy.empty(3, np.float32) for _ in range(size)] if rank == 0 else None
    dist.gather(cupy.full(3, rank, np.float32), gathered, dst=0)
    if rank == 0:
        for r in range(size):
            _close(gathered[r], np.full(3, r, np.float32), f"gather from {r}")
    target = cupy.empty(4, np.int64)
    pieces = [cupy.full(4, 7 * r, np.int64) for r in range(size)] if rank == 0 else None
    dist.scatter(target, pieces, src=0)
    _close(target, np.full(4, 7 * rank, np.int64), "scatter")
    # send/recv around a ring
    if size > 1:
        send = cupy.full(5, rank, np.float32)
        got = cupy.empty(5, np.float32)
        if rank % 2 == 0:
            dist.send(send, dst=(rank + 1) % size)
            dist.recv(got, src=(rank - 1) % size)
        else:
            dist.recv(got, src=(rank - 1) % size)
            dist.send(send, dst=(rank + 1) % size)
        _close(got, np.full(5, (rank - 1) % size, np.float32), "send/recv")
    dist.barrier()
    # async work backed by a CUDA event
    x = cupy.full(1 << 16, rank + 1, np.float32)
    work = dist.all_reduce(x, async_op=True)
    assert work.wait() and work.is_completed()
    _close(x, np.full(1 << 16, size * (size + 1) / 2, np.float32), "async all_reduce")
    # stream order: kernels before and after a synchronous call, on a user stream, no syncs
    with cupy.cuda.Stream(non_blocking=True) as stream:
        y = cupy.zeros(1 << 22, np.float32)
        y += rank + 1  # queued on `stream`; the all_reduce must wait for it
        dist.all_reduce(y)
        z = y * 2  # queued after; must see the reduced values
        stream.synchronize()
    _close(z, np.full(1 << 22, size * (size + 1), np.float32), "stream ordering")
    return {"rank": rank, "device": backend.device_id}


def check_subgroup() -> None:
    import cupy

    rank, size = dist.get_rank(), dist.get_world_size()
    members = list(range(0, size, 2))
    sub = dist.new_group(members)
    if rank in members:
        x = cupy.full(8, rank, np.float32)
        dist.all_reduce(x, group=sub)
        _close(x, np.full(8, sum(members), np.float32), "sub-group all_reduce")
        assert sub.backends["cuda"].comm is not dist.get_default_group().backends["cuda"].comm
        dist.destroy_process_group(sub)
    dist.barrier()


def check_hybrid_group() -> None:
    import cupy

    rank, size = dist.get_rank(), dist.get_world_size()
    host = np.full(5, rank + 1, np.int32)
    device = cupy.full(5, rank + 1, np.float32)
    dist.all_reduce(host)
    dist.all_reduce(device)
    _close(host, np.full(5, size * (size + 1) // 2, np.int32), "hybrid numpy")
    _close(device, np.full(5, size * (size + 1) / 2, np.float32), "hybrid cupy")
    bits = np.array([1 << rank], np.int64)
    dist.all_reduce(bits, op=ReduceOp.BOR)  # bitwise works through the CPU backend
    assert int(bits[0]) == (1 << size) - 1
    names = dist.all_gather_object(f"rank{rank}")  # pickled objects travel as numpy
    assert names == [f"rank{r}" for r in range(size)]


def check_refusals() -> None:
    import cupy

    try:
        dist.all_reduce(np.ones(3, np.float32))
    except TypeError as exc:
        assert "cpu:gloo,cuda:nccl" in str(exc), str(exc)
    else:
        raise AssertionError("a numpy array on an nccl-only group was accepted")
    try:
        dist.all_reduce(cupy.ones(3, np.int32), op=ReduceOp.BXOR)
    except TypeError as exc:
        assert "bitwise" in str(exc)
    else:
        raise AssertionError("BXOR on NCCL was accepted")


def check_hung_collective_aborts() -> str:
    """Rank 0 all-reduces alone; its Work times out, aborts the communicator and raises."""
    import cupy
    from pluribus.errors import DistTimeoutError, PluribusError

    rank = dist.get_rank()
    if rank != 0:
        return "idle"
    work = dist.all_reduce(cupy.ones(4, np.float32), async_op=True)
    try:
        work.wait(timeout=3.0)
    except DistTimeoutError as exc:
        assert "aborted" in str(exc)
    else:
        raise AssertionError("a collective no peer joined completed")
    try:
        dist.all_reduce(cupy.ones(4, np.float32))
    except PluribusError:
        return "aborted"
    raise AssertionError("the aborted communicator accepted more work")


# -- the tests ------------------------------------------------------------------------------------


@needs_gpu
def test_one_rank_on_one_gpu_every_collective():
    results = run_ranks(check_every_collective, 1, backend="nccl", mode="processes", timeout=300)
    assert results == [{"rank": 0, "device": 0}]


@needs_gpu
def test_refusals_on_gpu():
    run_ranks(check_refusals, 1, backend="nccl", mode="processes", timeout=120)


@needs_gpu
def test_hybrid_group_one_rank():
    run_ranks(check_hybrid_group, 1, backend=_hybrid_backend(1), mode="processes", timeout=120)


@needs_two_gpus
def test_multi_process_every_collective():
    size = _gpu_count()
    results = run_ranks(check_every_collective, size, backend="nccl", mode="processes", timeout=500)
    assert [r["device"] for r in results] == list(range(size)), "one GPU per rank"


@needs_two_gpus
def test_multi_process_subgroup():
    run_ranks(check_subgroup, _gpu_count(), backend="nccl", mode="processes", timeout=300)


@needs_two_gpus
def test_multi_process_hybrid_group():
    backend = _hybrid_backend(2)
    if backend is None:
        pytest.skip("the multi-process hybrid group needs the gloo plugin for numpy arrays")
    run_ranks(check_hybrid_group, _gpu_count(), backend=backend, mode="processes", timeout=300)


@needs_two_gpus
def test_hung_collective_aborts_the_communicator():
    results = run_ranks(
        check_hung_collective_aborts,
        2,
        backend="nccl",
        mode="processes",
        timeout=120,
        env={"CUDA_VISIBLE_DEVICES": _first_two_gpus()},
    )
    assert results == ["aborted", "idle"]


def _first_two_gpus() -> str:
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return ",".join(visible.split(",")[:2])
    return "0,1"
