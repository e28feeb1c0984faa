"""cupy arrays between two processes on one GPU, device to device through UCX's CUDA transports."""

from __future__ import annotations

import pluribus as pb
import pytest
from pluribus.testing import RankPool, gpu_unavailable

pytestmark = pytest.mark.gpu


def _gpu_reason() -> str | None:
    reason = gpu_unavailable("ucc")
    if reason:
        return reason
    if not pb.availability("ucc").details.get("cuda_transports"):
        return "UCX found no CUDA transport (cuda_copy/cuda_ipc) on this machine"
    return None


@pytest.fixture(scope="module")
def gpu_pool():
    reason = _gpu_reason()
    if reason:
        pytest.skip(reason)
    options = {"ucc_cuda": True}  # create the CUDA context before UCX starts
    with RankPool(2, "ucc", "processes", timeout=120, backend_options=options) as pool:
        yield pool


def _cupy_collectives() -> dict:
    import cupy

    rank, size = pb.get_rank(), pb.get_world_size()
    out = {}
    for n in (1, 1000, 3 << 20):  # small, medium, and large enough for the pipelined ring
        x = cupy.arange(n, dtype=cupy.float32) + rank
        pb.all_reduce(x)
        expected = cupy.arange(n, dtype=cupy.float32) * size + sum(range(size))
        assert isinstance(x, cupy.ndarray)
        assert bool(cupy.allclose(x, expected)), f"all_reduce n={n}"
    y = cupy.full(1 << 20, float(rank), dtype=cupy.float16)
    pb.broadcast(y, src=1)
    assert bool((y == 1).all()), "broadcast"
    parts = cupy.zeros(size * 4096, dtype=cupy.int32)
    pb.all_gather(parts, cupy.full(4096, rank, dtype=cupy.int32))
    assert bool((parts.reshape(size, 4096) == cupy.arange(size)[:, None]).all()), "all_gather"
    out["device"] = int(x.device.id)
    return out


@pytest.mark.timeout(300)
def test_cupy_all_reduce_broadcast_all_gather_between_two_processes(gpu_pool):
    assert gpu_pool.run(_cupy_collectives) == [{"device": 0}, {"device": 0}]


def _reduction_runs_on_the_gpu() -> bool:
    import cupy
    from pluribus_ucc import backend as ucc_backend

    calls = []
    original = ucc_backend.reduce_into

    def spy(dst, src, op):
        calls.append((type(dst).__module__, type(src).__module__))
        return original(dst, src, op)

    ucc_backend.reduce_into = spy
    try:
        x = cupy.ones(2 << 20, dtype=cupy.float32)
        pb.all_reduce(x)
    finally:
        ucc_backend.reduce_into = original
    assert calls and all(a.startswith("cupy") and b.startswith("cupy") for a, b in calls)
    return bool((x == pb.get_world_size()).all())


@pytest.mark.timeout(300)
def test_reductions_on_gpu_arrays_run_on_the_gpu(gpu_pool):
    assert gpu_pool.run(_reduction_runs_on_the_gpu) == [True, True]
