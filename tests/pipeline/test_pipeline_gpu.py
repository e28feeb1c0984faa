"""Pipeline schedules with cupy stages: losses, outputs and every stage's gradients equal one
numpy process on the whole batch, as on the CPU.

Multi-rank runs use ucc (two or four processes sharing the one GPU; activations and gradients
move through CUDA IPC, their headers through host memory); NCCL cannot put two ranks on one
GPU, so it runs every schedule at world size 1 (the multi-stage schedules then hold two stages
on the one rank). ``scripts/gpu-checks.sh`` runs these on a GPU machine; elsewhere they skip
with the reason."""

import pytest
from pipeline_cases import check_parity, pipeline_train_on_rank
from pluribus.parallel import pipeline as pp
from pluribus.testing import needs_gpu, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@needs_gpu("ucc")
@pytest.mark.parametrize("name", list(pp.SCHEDULES))
@pytest.mark.parametrize("p,m", [(2, 5), (4, 4)])
def test_cupy_stages_over_ucc_equal_one_process(name, p, m):
    results = run_ranks(
        pipeline_train_on_rank, p, "ucc", "processes", timeout=300,
        backend_options={"ucc_cuda": True}, args=(name, m, 2, 0.1, "cuda"),
    )  # fmt: skip
    check_parity(results, m, name=name)


@needs_gpu("nccl")
@pytest.mark.parametrize("name", list(pp.SCHEDULES))
def test_cupy_stages_over_nccl_at_world_size_one_equal_one_process(name):
    results = run_ranks(
        pipeline_train_on_rank, 1, "cpu:gloo,cuda:nccl", "processes", timeout=300,
        args=(name, 3, 2, 0.1, "cuda"),
    )  # fmt: skip
    check_parity(results, 3, name=name)
