"""DDP and SyncBatchNorm with ranks as separate processes, on every backend that can carry them.

The ranks are spawned once per backend and world size (a :class:`RankPool`) and reused by the
cases. ``storebackend`` is the example third-party backend (send/recv only, through the store):
it shows DDP needs nothing but the public collectives. Backends that are not installed or
cannot run here are skipped with the reason.
"""

import numpy as np
import pytest
from ddp_cases import (
    check_matches_reference,
    ddp_gpt_train_on_rank,
    ddp_train_counting_zero_copy,
    ddp_train_on_rank,
    reference_gpt_train,
    reference_train,
)

pytestmark = pytest.mark.timeout(240)

SMALL_BUCKETS_MB = 4096 / 2**20
BACKENDS = ["gloo", "ucc", "storebackend"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("accum", [1, 2], ids=["sync-every-step", "no_sync-accumulation"])
def test_ddp_processes_equal_single_process_on_concatenated_batch(
    process_pools, backend, world, accum
):
    per_rank, steps = 8, 3
    results = process_pools(backend, world).run(
        ddp_train_on_rank, per_rank, steps, accum, SMALL_BUCKETS_MB
    )
    assert results[0]["buckets"] >= 3
    check_matches_reference(results, world, per_rank, steps, accum)


def test_ddp_on_gloo_reduces_large_buckets_without_copying_them_in(process_pools):
    """Buckets are symmetric arrays on a group with an arena: one of about 3 MiB (above the
    one-shot size) runs gloo's zero-copy all-reduce at every step, and training still equals
    one process on the whole batch."""
    world, per_rank, steps, hidden = 2, 8, 2, 16384
    results = process_pools("gloo", world).run(
        ddp_train_counting_zero_copy, per_rank, steps, 1, 25, None, False, True, hidden
    )
    for result in results:
        assert len(result["zero_copy"]) == steps and min(result["zero_copy"]) > 700_000
    check_matches_reference(results, world, per_rank, steps, 1, hidden=hidden)


@pytest.mark.parametrize("backend", BACKENDS)
def test_syncbatchnorm_processes_equal_batchnorm_on_full_batch(process_pools, backend):
    world, per_rank, steps = 2, 6, 3
    results = process_pools(backend, world).run(
        ddp_train_on_rank, per_rank, steps, 1, SMALL_BUCKETS_MB, None, True
    )
    check_matches_reference(
        results, world, per_rank, steps, 1, batchnorm=True, rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hook, tolerance", [("fp16", 2e-4), ("bf16", 1e-3)])
def test_compression_hooks_processes_stay_within_tolerance(process_pools, backend, hook, tolerance):
    """Same stated tolerance as on threads: every parameter within ``tolerance`` of the
    full-precision single-process run after 6 steps."""
    world, per_rank, steps = 2, 16, 6
    results = process_pools(backend, world).run(
        ddp_train_on_rank, per_rank, steps, 1, SMALL_BUCKETS_MB, hook
    )
    reference = reference_train(world, per_rank, steps, 1)
    worst = max(np.abs(results[0]["state"][k] - v).max() for k, v in reference.items())
    assert 0 < worst < tolerance


def test_gpt_under_ddp_on_gloo_equals_one_process_on_the_whole_batch(process_pools):
    """Float64, tied head (a gradient that arrives twice), several buckets with overlap: the
    mean of the ranks' losses is the whole batch's loss at every step, to round-off."""
    world, per_rank, steps = 2, 3, 4
    results = process_pools("gloo", world).run(ddp_gpt_train_on_rank, per_rank, steps, 8192 / 2**20)
    assert results[0]["buckets"] >= 3
    expected = reference_gpt_train(world, per_rank, steps)
    ddp_losses = np.mean([r["losses"] for r in results], axis=0)
    np.testing.assert_allclose(ddp_losses, expected["losses"], rtol=1e-12)
    assert expected["losses"][-1] < expected["losses"][0]
    for name, value in expected["state"].items():
        np.testing.assert_array_equal(results[1]["state"][name], results[0]["state"][name])
        np.testing.assert_allclose(results[0]["state"][name], value, rtol=1e-9, atol=1e-12)
