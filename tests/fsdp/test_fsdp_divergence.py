"""A rank that skips a unit's forward (and so its backward) makes every rank raise an error
naming the unit and the ranks, instead of hanging or silently mixing up parameters."""

import numpy as np
import pluribus
import pytest
from pluribus import nn
from pluribus.parallel import fully_shard
from pluribus.testing import RanksFailed, require_backend, run_ranks

pytestmark = pytest.mark.timeout(60)

WIDTH = 8


class Stack(nn.Module):
    """Linear layers in a row; ``skip`` leaves one out of forward and backward."""

    def __init__(self, same_sizes=True):
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Linear(WIDTH, WIDTH, bias=same_sizes or i != 2, rng=i) for i in range(4)]
        )
        self.skip = None

    def _used(self):
        return [layer for i, layer in enumerate(self.layers) if i != self.skip]

    def forward(self, x):
        for layer in self._used():
            x = layer.forward(x)
        return x

    def backward(self, grad):
        for layer in reversed(self._used()):
            grad = layer.backward(grad)
        return grad


def diverging_on_rank(prefetch, same_sizes=True):
    model = Stack(same_sizes)
    for layer in model.layers:
        fully_shard(layer, prefetch=prefetch)
    fully_shard(model, prefetch=prefetch)
    for step in range(2):
        model.skip = 1 if step == 1 and pluribus.get_rank() == 1 else None
        y = model.forward(np.ones((2, WIDTH), np.float32))
        model.backward(np.ones_like(y))


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_rank_skipping_a_unit_fails_every_rank_naming_it(prefetch):
    with pytest.raises(RanksFailed) as failed:
        run_ranks(diverging_on_rank, 2, "threads", args=(prefetch,), timeout=20)
    errors = failed.value.errors
    assert sorted(e.rank for e in errors) == [0, 1]
    for error in errors:
        assert error.kind == "RuntimeError", error.message
        assert "ranks ran different units" in error.message
        assert "'layers.1'" in error.message and "rank 1" in error.message


def test_units_of_other_sizes_fail_naming_the_unit_too():
    with pytest.raises(RanksFailed) as failed:
        run_ranks(diverging_on_rank, 2, "threads", args=(False, False), timeout=20)
    for error in failed.value.errors:
        assert "ranks ran different units" in error.message, error.message
        assert f"rank {error.rank}" in error.message
    named = {e.rank: e.message for e in failed.value.errors}
    assert "'layers.1'" in named[0] and "'layers.2'" in named[1]


def test_on_gloo_processes_too():
    require_backend("gloo")
    with pytest.raises(RanksFailed) as failed:
        run_ranks(diverging_on_rank, 2, "gloo", "processes", timeout=60, args=(True,))
    assert sorted(e.rank for e in failed.value.errors) == [0, 1]
    for error in failed.value.errors:
        assert "ranks ran different units" in error.message, error.message
