"""SyncBatchNorm on thread ranks against BatchNorm1d on the concatenated batch."""

import numpy as np
import pluribus
import pytest
from pluribus import nn
from pluribus.parallel import SyncBatchNorm, convert_sync_batchnorm
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


def _rows(world):
    """Uneven local batches: rank r holds r + 2 rows."""
    counts = [r + 2 for r in range(world)]
    starts = np.cumsum([0] + counts)
    return counts, starts


def _data(world, shape_tail, dtype):
    counts, _ = _rows(world)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((sum(counts), *shape_tail)) * 2 + 1).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    return x, g


def _sync_step(shape_tail, dtype):
    rank, world = pluribus.get_rank(), pluribus.get_world_size()
    x, g = _data(world, shape_tail, dtype)
    _, starts = _rows(world)
    mine = slice(starts[rank], starts[rank + 1])
    bn = SyncBatchNorm(shape_tail[0]).to(dtype=dtype)
    bn.weight.data[...] = np.linspace(0.5, 1.5, shape_tail[0])
    y = bn.forward(x[mine])
    dx = bn.backward(g[mine])
    # parameter gradients are local sums; their sum over ranks is the full-batch gradient
    grads = np.concatenate([bn.weight.grad, bn.bias.grad])
    pluribus.all_reduce(grads)
    bn.eval()
    y_eval = bn.forward(x[mine])
    return y, dx, grads, bn.running_mean.copy(), bn.running_var.copy(), y_eval


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shape_tail", [(4,), (3, 5)], ids=["NC", "NCL"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_syncbatchnorm_equals_batchnorm_on_the_concatenated_batch(world, shape_tail, dtype):
    results = run_ranks(_sync_step, world, "threads", args=(shape_tail, dtype))
    x, g = _data(world, shape_tail, dtype)
    bn = nn.BatchNorm1d(shape_tail[0]).to(dtype=dtype)
    bn.weight.data[...] = np.linspace(0.5, 1.5, shape_tail[0])
    y = bn.forward(x)
    dx = bn.backward(g)
    bn.eval()
    y_eval = bn.forward(x)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == np.float64 else {"rtol": 1e-4, "atol": 1e-5}
    _, starts = _rows(world)
    for rank, (ys, dxs, grads, mean, var, ys_eval) in enumerate(results):
        rows = slice(starts[rank], starts[rank + 1])
        np.testing.assert_allclose(ys, y[rows], **tol)
        np.testing.assert_allclose(dxs, dx[rows], **tol)
        np.testing.assert_allclose(grads, np.concatenate([bn.weight.grad, bn.bias.grad]), **tol)
        np.testing.assert_allclose(mean, bn.running_mean, **tol)
        np.testing.assert_allclose(var, bn.running_var, **tol)
        np.testing.assert_allclose(ys_eval, y_eval[rows], **tol)


def test_convert_sync_batchnorm_keeps_parameters_and_statistics():
    model = nn.Sequential(
        nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=0.2), nn.Sequential(nn.BatchNorm1d(4, eps=1e-3))
    )
    params = model.parameters()
    model[1].running_mean[...] = 5
    model.eval()
    converted = convert_sync_batchnorm(model)
    assert converted is model
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[2][0], SyncBatchNorm)
    assert model[1].momentum == 0.2 and model[2][0].eps == 1e-3 and not model[1].training
    assert model.parameters() == params  # the same Parameter objects: optimizers stay valid
    np.testing.assert_array_equal(model[1].running_mean, 5)
    single = convert_sync_batchnorm(nn.BatchNorm1d(2))
    assert isinstance(single, SyncBatchNorm)


def test_syncbatchnorm_outside_a_group_behaves_like_batchnorm():
    x = np.random.default_rng(0).standard_normal((6, 3))
    sync, plain = SyncBatchNorm(3).to(dtype=np.float64), nn.BatchNorm1d(3).to(dtype=np.float64)
    np.testing.assert_allclose(sync.forward(x), plain.forward(x))
    np.testing.assert_allclose(sync.backward(x), plain.backward(x))
