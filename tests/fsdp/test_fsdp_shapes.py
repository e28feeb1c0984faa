"""Any parameter shapes on any number of ranks: sharding, gathering and the reduce-scatter put
every element where it belongs (hypothesis picks the shapes, including first dimensions
smaller than the ranks and of size 0 on some)."""

import numpy as np
import pluribus
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pluribus import nn
from pluribus.parallel import fully_shard
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


class Bag(nn.Module):
    """Parameters of the given shapes; forward returns the input, backward gives each
    parameter a gradient that names its rank and elements."""

    def __init__(self, shapes):
        super().__init__()
        for i, shape in enumerate(shapes):
            data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1000 * i
            setattr(self, f"p{i}", nn.Parameter(data))

    def forward(self, x):
        return x

    def backward(self, grad):
        for _, p in self.named_parameters():
            p.accumulate_grad(np.full(p.data.shape, pluribus.get_rank() + 1.0, np.float32))
        return grad


def bag_on_rank(shapes, strategy):
    model = fully_shard(Bag(shapes), strategy=strategy)
    model.forward(np.zeros(1, np.float32))
    model.backward(np.zeros(1, np.float32))
    sharded = {n: (d.to_local().copy(), d.layout.local_slices(d.device_mesh.coordinate))
               for n, d in model.state_dict().items()}  # fmt: skip
    grads = {n: p.grad.copy() for n, p in model.named_parameters()}
    return sharded, grads, model.full_state_dict()


shapes = st.lists(
    st.tuples(st.integers(1, 7), st.integers(1, 3)).map(lambda t: t if t[1] > 1 else t[:1]),
    min_size=1,
    max_size=4,
)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(shapes=shapes, world=st.sampled_from([2, 3, 4]), strategy=st.sampled_from(
    ["full_shard", "shard_grad_op", "shard_optimizer_state"]))  # fmt: skip
def test_shards_gathers_and_gradients_land_on_the_right_elements(shapes, world, strategy):
    reference = Bag(shapes).state_dict()
    mean_grad = sum(r + 1.0 for r in range(world)) / world
    for rank, (sharded, grads, full) in enumerate(
        run_ranks(bag_on_rank, world, "threads", args=(shapes, strategy))
    ):
        for name, (local, where) in sharded.items():
            np.testing.assert_array_equal(local, reference[name][where])
            assert grads[name].shape == local.shape
            np.testing.assert_allclose(grads[name], mean_grad)
        if rank == 0:
            for name, value in reference.items():
                np.testing.assert_array_equal(full[name], value)
