"""Where pluribus.nn must behave as torch does: each case was found by running the same
computation in PyTorch (the torch side itself is in test_nn_torch_parity.py)."""

import math

import numpy as np
import pytest
from pluribus import nn
from pluribus.data import DistributedSampler
from test_nn_gradients import check_module, numerical_grad

pytestmark = pytest.mark.timeout(60)


def test_sgd_momentum_and_weight_decay_update_a_0d_parameter_every_step():
    """torch's rule by hand: g = grad + wd p; buf = g, then mu buf + g; p -= lr buf."""
    param = nn.Parameter(np.array(1.0))
    opt = nn.SGD([param], lr=0.1, momentum=0.9, weight_decay=0.1)
    p, buf = 1.0, None
    for _ in range(4):
        param.grad = np.array(2.0 * float(param.data))  # d(p^2)/dp
        opt.step()
        g = 2.0 * p + 0.1 * p
        buf = g if buf is None else 0.9 * buf + g
        p -= 0.1 * buf
        assert float(param.data) == pytest.approx(p, rel=1e-12)
    assert isinstance(opt.state[0]["momentum_buffer"], np.ndarray)


def test_adamw_keeps_its_step_counter_an_integer_through_load_state_dict():
    param = nn.Parameter(np.ones(3, dtype=np.float16))
    opt = nn.AdamW([param], lr=1e-3)
    param.grad = np.full(3, 0.5, dtype=np.float16)
    opt.step()
    state = opt.state_dict()
    state["0.step"] = np.array(2048)
    fresh = nn.AdamW([param], lr=1e-3)
    fresh.load_state_dict(state)
    for _ in range(2):
        fresh.step()
    assert fresh.state[0]["step"].dtype.kind == "i"
    assert int(fresh.state[0]["step"]) == 2050  # a float16 counter sticks at 2048
    assert fresh.state[0]["exp_avg"].dtype == np.float16


def test_layernorm_over_several_trailing_dimensions_as_torch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4))
    norm = nn.LayerNorm((3, 4)).to(dtype=np.float64)
    assert norm.weight.shape == (3, 4)
    mean = x.mean(axis=(1, 2), keepdims=True)
    var = x.var(axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(norm.forward(x), (x - mean) / np.sqrt(var + 1e-5), rtol=1e-12)
    norm.weight.data[...] = rng.standard_normal((3, 4))
    check_module(norm, x, rng)


def test_layernorm_refuses_an_input_whose_trailing_shape_differs():
    with pytest.raises(ValueError, match=r"trailing dimensions \(3, 4\).*shape \(2, 4, 3\)"):
        nn.LayerNorm((3, 4)).forward(np.ones((2, 4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match=r"shape \(5, 3\)"):
        nn.LayerNorm(4).forward(np.ones((5, 3), dtype=np.float32))


@pytest.mark.parametrize("label", [-1, 3])
def test_cross_entropy_refuses_labels_outside_the_classes(label):
    logits = np.zeros((2, 3), dtype=np.float32)
    with pytest.raises(IndexError, match=f"label {label}, outside 0..2"):
        nn.CrossEntropyLoss().forward(logits, np.array([0, label]))


def test_cross_entropy_ignore_index_and_label_smoothing_follow_torch_formula():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 4))
    target = np.array([1, -100, 3, 0, -100])
    eps = 0.2
    loss = nn.CrossEntropyLoss(label_smoothing=eps)
    value = float(loss.forward(logits, target))
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    rows = [0, 2, 3]
    per_row = [-(1 - eps) * log_p[r, target[r]] - eps * log_p[r].mean() for r in rows]
    assert value == pytest.approx(np.mean(per_row), rel=1e-12)
    grad = loss.backward()
    np.testing.assert_array_equal(grad[[1, 4]], 0)
    expected = numerical_grad(lambda: float(loss.forward(logits, target)), logits)
    np.testing.assert_allclose(grad, expected, atol=1e-8)
    everything_ignored = nn.CrossEntropyLoss(ignore_index=7)
    assert math.isnan(float(everything_ignored.forward(logits[:2], np.array([7, 7]))))


def test_batchnorm_training_refuses_one_value_per_channel_and_keeps_running_var():
    bn = nn.BatchNorm1d(3)
    for shape in [(1, 3), (1, 3, 1)]:
        with pytest.raises(ValueError, match="more than one value per channel"):
            bn.forward(np.ones(shape, dtype=np.float32))
    np.testing.assert_array_equal(bn.running_var, np.ones(3))
    bn.forward(np.arange(6, dtype=np.float32).reshape(1, 3, 2))  # two values per channel: fine
    bn.eval()
    bn.forward(np.ones((1, 3), dtype=np.float32))  # running statistics: fine


def test_distributed_sampler_takes_a_dataset_with_len_like_torch():
    dataset = [("sample", i) for i in range(10)]
    shares = [DistributedSampler(dataset, 3, r, seed=1).indices() for r in range(3)]
    assert [len(s) for s in shares] == [4, 4, 4]
    np.testing.assert_array_equal(
        shares[1], DistributedSampler(len(dataset), 3, 1, seed=1).indices()
    )
    with pytest.raises(TypeError, match="len()"):
        DistributedSampler(object(), 2, 0)


def test_gelu_is_exact_by_default_and_tanh_on_request():
    x = np.linspace(-6, 6, 41)
    exact = np.array([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x])
    np.testing.assert_allclose(nn.GELU().forward(x), exact, rtol=1e-13, atol=1e-300)
    tanh = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(nn.GELU(approximate="tanh").forward(x), tanh, rtol=1e-13)
    assert repr(nn.GELU()) == "GELU(approximate='none')"
    with pytest.raises(ValueError, match="'none' or 'tanh'"):
        nn.GELU(approximate="fast")


def test_parameter_groups_take_their_own_learning_rate_and_a_scheduler_changes_them():
    a, b = nn.Parameter(np.zeros(2)), nn.Parameter(np.zeros(2))
    opt = nn.SGD([{"params": [a]}, {"params": [b], "lr": 1.0}], lr=0.1, momentum=0.0)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 1.0]
    scheduler = nn.LambdaLR(opt, lambda step: 0.5**step)
    for expected in ([0.1, 1.0], [0.05, 0.5]):
        a.grad, b.grad = np.ones(2), np.ones(2)
        before = a.data.copy(), b.data.copy()
        opt.step()
        np.testing.assert_allclose(before[0] - a.data, expected[0])
        np.testing.assert_allclose(before[1] - b.data, expected[1])
        scheduler.step()
    assert scheduler.get_last_lr() == [0.025, 0.25]
    resumed = nn.SGD([{"params": [a]}, {"params": [b], "lr": 1.0}], lr=0.1)
    resumed.load_state_dict(opt.state_dict())
    assert [g["lr"] for g in resumed.param_groups] == [0.025, 0.25]
    with pytest.raises(ValueError, match="unknown hyperparameters"):
        nn.SGD([{"params": [a], "betas": (0.9, 0.99)}])
