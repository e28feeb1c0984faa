"""Every reference layer's backward against central finite differences, in float64."""

import numpy as np
import pytest
from pluribus import nn

pytestmark = pytest.mark.timeout(60)


def numerical_grad(f, array, eps=1e-6):
    """d f() / d array by central differences, perturbing ``array`` in place."""
    grad = np.zeros_like(array)
    flat, gflat = array.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        plus = f()
        flat[i] = old - eps
        minus = f()
        flat[i] = old
        gflat[i] = (plus - minus) / (2 * eps)
    return grad


def check_module(module, x, rng, atol=1e-6, rtol=1e-5):
    module.to(dtype=np.float64)
    x = x.astype(np.float64)
    out = module.forward(x)
    weights = rng.standard_normal(out.shape)

    def loss():
        return float((module.forward(x) * weights).sum())

    module.zero_grad()
    module.forward(x)
    grad_x = module.backward(weights.copy())
    np.testing.assert_allclose(grad_x, numerical_grad(loss, x), atol=atol, rtol=rtol)
    for name, param in module.named_parameters():
        expected = numerical_grad(loss, param.data)
        np.testing.assert_allclose(param.grad, expected, atol=atol, rtol=rtol, err_msg=name)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Linear(5, 4, rng=0), (3, 5)),
        (lambda: nn.Linear(5, 4, bias=False, rng=1), (2, 3, 5)),
        (lambda: nn.ReLU(), (4, 6)),
        (lambda: nn.GELU(), (4, 6)),
        (lambda: nn.Tanh(), (4, 6)),
        (lambda: nn.LayerNorm(6), (4, 6)),
        (lambda: nn.LayerNorm(6), (2, 3, 6)),
        (lambda: nn.BatchNorm1d(5), (7, 5)),
        (lambda: nn.BatchNorm1d(3), (4, 3, 5)),
        (lambda: nn.BatchNorm1d(3, affine=False), (6, 3)),
        (
            lambda: nn.Sequential(
                nn.Linear(6, 8, rng=2), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 3, rng=3)
            ),
            (5, 6),
        ),
    ],
    ids=[
        "linear",
        "linear-3d-nobias",
        "relu",
        "gelu",
        "tanh",
        "layernorm",
        "layernorm-3d",
        "batchnorm",
        "batchnorm-3d",
        "batchnorm-noaffine",
        "sequential",
    ],
)
def test_layer_gradients_match_finite_differences(make, shape):
    rng = np.random.default_rng(42)
    x = rng.standard_normal(shape)
    if "ReLU" in repr(make()):
        x[np.abs(x) < 1e-3] = 0.5  # keep away from the kink
    check_module(make(), x, rng)


def test_batchnorm_eval_uses_running_statistics_and_its_gradient():
    rng = np.random.default_rng(0)
    bn = nn.BatchNorm1d(4).to(dtype=np.float64)
    x = rng.standard_normal((32, 4)) * 3 + 2
    bn.forward(x)
    expected_mean = 0.1 * x.mean(axis=0)
    np.testing.assert_allclose(bn.running_mean, expected_mean, rtol=1e-12)
    np.testing.assert_allclose(bn.running_var, 0.9 + 0.1 * x.var(axis=0, ddof=1), rtol=1e-12)
    bn.eval()
    check_module(bn, rng.standard_normal((3, 4)), rng)


def test_embedding_gradient_adds_repeated_indices():
    rng = np.random.default_rng(0)
    emb = nn.Embedding(5, 3, rng=0).to(dtype=np.float64)
    idx = np.array([[0, 2], [2, 4]])
    out = emb.forward(idx)
    np.testing.assert_array_equal(out[1, 0], emb.weight.data[2])
    weights = rng.standard_normal(out.shape)

    def loss():
        return float((emb.forward(idx) * weights).sum())

    emb.forward(idx)
    assert emb.backward(weights) is None
    np.testing.assert_allclose(emb.weight.grad, numerical_grad(loss, emb.weight.data), atol=1e-6)
    assert np.all(emb.weight.grad[[1, 3]] == 0)


@pytest.mark.parametrize("loss_cls", [nn.CrossEntropyLoss, nn.MSELoss])
def test_loss_gradients_match_finite_differences(loss_cls):
    rng = np.random.default_rng(1)
    pred = rng.standard_normal((6, 4))
    if loss_cls is nn.CrossEntropyLoss:
        target = rng.integers(0, 4, 6)
    else:
        target = rng.standard_normal((6, 4))
    loss = loss_cls()

    def value():
        return float(loss.forward(pred, target))

    value()
    grad = loss.backward()
    np.testing.assert_allclose(grad, numerical_grad(value, pred), atol=1e-7)


def test_cross_entropy_value_matches_log_softmax():
    logits = np.array([[1.0, 2.0, 3.0], [1000.0, 0.0, -1000.0]])
    target = np.array([2, 0])
    expected = -np.mean([3 - np.log(np.exp(1) + np.exp(2) + np.exp(3)), 0.0])
    assert np.isclose(float(nn.CrossEntropyLoss().forward(logits, target)), expected)


def test_dropout_masks_scales_and_turns_off_in_eval():
    drop = nn.Dropout(0.25, seed=3)
    x = np.ones((400, 50), dtype=np.float32)
    y = drop.forward(x)
    kept = y != 0
    assert 0.7 < kept.mean() < 0.8
    np.testing.assert_allclose(y[kept], 1 / 0.75)
    g = drop.backward(np.ones_like(x))
    np.testing.assert_array_equal(g, y)
    drop.eval()
    assert drop.forward(x) is x


def test_accumulate_grad_adds_and_runs_hooks():
    layer = nn.Linear(3, 2, rng=0)
    seen = []
    handle = layer.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.copy()))
    x = np.ones((1, 3), dtype=np.float32)
    layer.forward(x)
    layer.backward(np.ones((1, 2), dtype=np.float32))
    layer.forward(x)
    layer.backward(np.ones((1, 2), dtype=np.float32))
    np.testing.assert_allclose(layer.weight.grad, 2 * np.ones((2, 3)))
    assert len(seen) == 2
    handle.remove()
    layer.forward(x)
    layer.backward(np.ones((1, 2), dtype=np.float32))
    assert len(seen) == 2
