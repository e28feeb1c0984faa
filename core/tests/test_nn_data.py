"""DistributedSampler: disjoint shares that cover the data, equal counts, new order per epoch."""

import numpy as np
import pytest
from pluribus.data import DistributedSampler

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("n, world", [(10, 3), (12, 4), (5, 8)])
def test_shares_cover_the_data_with_equal_counts(n, world):
    shares = [DistributedSampler(n, world, r, seed=3).indices() for r in range(world)]
    assert {len(s) for s in shares} == {-(-n // world)}
    together = np.concatenate(shares)
    assert set(together.tolist()) == set(range(n))
    assert len(together) - n == (-n) % world  # only the padding repeats


def test_drop_last_gives_disjoint_shares_and_epochs_reshuffle():
    shares = [DistributedSampler(10, 3, r, drop_last=True).indices() for r in range(3)]
    together = np.concatenate(shares)
    assert len(together) == 9 == len(set(together.tolist()))
    sampler = DistributedSampler(100, 2, 0, seed=1)
    first = sampler.indices()
    np.testing.assert_array_equal(first, DistributedSampler(100, 2, 0, seed=1).indices())
    sampler.set_epoch(1)
    assert not np.array_equal(first, sampler.indices())
    ordered = DistributedSampler(7, 2, 1, shuffle=False)
    assert list(ordered) == [1, 3, 5, 0]
    assert [b.tolist() for b in ordered.batches(3)] == [[1, 3, 5], [0]]
    assert [b.tolist() for b in ordered.batches(3, drop_last=True)] == [[1, 3, 5]]


def test_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        DistributedSampler(10, 2, 2)
