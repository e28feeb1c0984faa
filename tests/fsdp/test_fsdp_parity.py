"""FSDP on 2 and 4 thread ranks equals one process training on the whole batch: per-step
losses, every rank's shards (the matching rows of the reference), and the full state dict
gathered on rank 0; for each strategy, with and without prefetch, mixed precision, gradient
accumulation and clipping. The MLP's first dimensions (30, 3, 5) are not divisible by the
ranks and 3 is smaller than 4, so uneven and empty shards are covered."""

import numpy as np
import pytest
from fsdp_cases import check_matches_reference, fsdp_train_on_rank, reference_train
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

PER_RANK, STEPS = 4, 3
CASES = [
    ("full_shard", 2),
    ("full_shard", 4),
    ("shard_grad_op", 2),
    ("shard_grad_op", 4),
    ("shard_optimizer_state", 2),
    ("shard_optimizer_state", 4),
    ("no_shard", 2),
    ("hybrid_shard", 4),
]


def _run(model, strategy, world, accum=1, prefetch=True, mp=False, clip=None):
    args = (model, strategy, PER_RANK, STEPS, accum, prefetch, mp, clip)
    return run_ranks(fsdp_train_on_rank, world, "threads", args=args)


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("strategy,world", CASES)
def test_each_strategy_equals_single_process_training(model, strategy, world):
    results = _run(model, strategy, world)
    check_matches_reference(results, reference_train(model, world, PER_RANK, STEPS))


@pytest.mark.parametrize("strategy,world", [("full_shard", 2), ("hybrid_shard", 4)])
def test_without_prefetch_gives_the_same_model(strategy, world):
    results = _run("gpt", strategy, world, prefetch=False)
    check_matches_reference(results, reference_train("gpt", world, PER_RANK, STEPS))


@pytest.mark.parametrize("strategy,world", CASES[::2] + [("hybrid_shard", 4)])
def test_no_sync_accumulation_equals_the_summed_batch(strategy, world):
    results = _run("gpt", strategy, world, accum=2)
    check_matches_reference(results, reference_train("gpt", world, PER_RANK, STEPS, accum=2))


@pytest.mark.parametrize(
    "strategy,world",
    [("full_shard", 2), ("shard_grad_op", 4), ("shard_optimizer_state", 2), ("no_shard", 2)],
)
def test_mixed_precision_float16_stays_close_to_float32_training(strategy, world):
    results = _run("gpt", strategy, world, mp=True)
    reference = reference_train("gpt", world, PER_RANK, STEPS)
    check_matches_reference(results, reference, rtol=2e-2, atol=2e-2)
    # float16 compute really ran: the losses are close, not equal
    assert results[0]["losses"] != pytest.approx(reference["losses"], rel=1e-6, abs=0)
    # master weights stay float32
    assert all(v.dtype == np.float32 for v in results[0]["full"].values())


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize(
    "strategy,world",
    [("full_shard", 2), ("shard_optimizer_state", 4), ("no_shard", 2), ("hybrid_shard", 4)],
)
def test_clip_grad_norm_equals_single_process_clipping(strategy, world, norm_type):
    clip = (0.05, norm_type)  # small enough that every step clips
    results = _run("mlp", strategy, world, clip=clip)
    reference = reference_train("mlp", world, PER_RANK, STEPS, clip=clip)
    assert min(reference["norms"]) > 0.05
    for result in results:
        np.testing.assert_allclose(result["norms"], reference["norms"], rtol=1e-5)
    check_matches_reference(results, reference)
