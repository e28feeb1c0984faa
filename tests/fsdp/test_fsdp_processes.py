"""FSDP with ranks as separate processes on gloo (and the send/recv-only example backend,
which shows FSDP needs nothing but the public collectives): the same parity as on threads."""

import pytest
from fsdp_cases import check_matches_reference, fsdp_train_on_rank, reference_train

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(
    "backend,world,strategy",
    [
        ("gloo", 2, "full_shard"),
        ("gloo", 2, "shard_grad_op"),
        ("gloo", 2, "shard_optimizer_state"),
        ("gloo", 2, "no_shard"),
        ("gloo", 4, "full_shard"),
        ("gloo", 4, "hybrid_shard"),
        ("storebackend", 2, "shard_grad_op"),
    ],
)
def test_processes_equal_single_process_training(process_pools, backend, world, strategy):
    results = process_pools(backend, world).run(fsdp_train_on_rank, "gpt", strategy, 4, 3)
    check_matches_reference(results, reference_train("gpt", world, 4, 3))


@pytest.mark.parametrize("prefetch,mp", [(False, False), (True, True)])
def test_gloo_without_prefetch_and_with_float16(process_pools, prefetch, mp):
    results = process_pools("gloo", 4).run(
        fsdp_train_on_rank, "mlp", "full_shard", 4, 3, 1, prefetch, mp
    )
    tolerance = (2e-2, 2e-2) if mp else (1e-4, 1e-5)
    check_matches_reference(results, reference_train("mlp", 4, 4, 3), *tolerance)
