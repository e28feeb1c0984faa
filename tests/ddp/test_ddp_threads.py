"""DDP on N thread ranks equals one process training on the concatenated batch."""

import pytest
from ddp_cases import check_matches_reference, ddp_train_on_rank
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

SMALL_BUCKETS_MB = 4096 / 2**20  # 4 KiB: the 3-layer model spreads over several buckets


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("accum", [1, 3], ids=["sync-every-step", "no_sync-accumulation"])
def test_ddp_equals_single_process_on_concatenated_batch(world, accum):
    per_rank, steps = 8, 4
    results = run_ranks(
        ddp_train_on_rank, world, "threads", args=(per_rank, steps, accum, SMALL_BUCKETS_MB)
    )
    assert results[0]["buckets"] >= 3
    check_matches_reference(results, world, per_rank, steps, accum)


def test_ddp_without_overlap_and_with_one_bucket_gives_the_same_model():
    world, per_rank, steps = 2, 8, 3
    one_bucket = run_ranks(ddp_train_on_rank, world, "threads", args=(per_rank, steps, 1, 25))
    assert one_bucket[0]["buckets"] == 1
    check_matches_reference(one_bucket, world, per_rank, steps, 1)
    late = run_ranks(
        ddp_train_on_rank,
        world,
        "threads",
        args=(per_rank, steps, 1, SMALL_BUCKETS_MB, None, False, False),
    )
    check_matches_reference(late, world, per_rank, steps, 1)


def test_syncbatchnorm_under_ddp_equals_batchnorm_on_the_full_batch():
    world, per_rank, steps = 4, 6, 3
    results = run_ranks(
        ddp_train_on_rank,
        world,
        "threads",
        args=(per_rank, steps, 1, SMALL_BUCKETS_MB, None, True),
    )
    # running statistics included: they come from the whole batch on every rank
    check_matches_reference(
        results, world, per_rank, steps, 1, batchnorm=True, rtol=1e-4, atol=1e-5
    )
