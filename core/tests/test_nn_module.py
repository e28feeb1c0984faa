"""The module protocol (state, modes, traversal) and the optimizers' update rules."""

import numpy as np
import pytest
from pluribus import nn

pytestmark = pytest.mark.timeout(60)


def mlp(seed=0):
    return nn.Sequential(
        nn.Linear(4, 8, rng=seed), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3, rng=seed + 1)
    )


def test_named_parameters_buffers_and_state_dict_round_trip():
    model = mlp()
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert [n for n, _ in model.named_buffers()] == [
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    model.forward(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32))
    state = model.state_dict()
    other = mlp(seed=7)
    weight_object = other[0].weight.data
    other.load_state_dict(state)
    assert other[0].weight.data is weight_object  # loaded in place
    for key, value in other.state_dict().items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    with pytest.raises(KeyError, match="missing keys"):
        other.load_state_dict({k: v for k, v in state.items() if k != "3.bias"})
    bad = dict(state, **{"3.bias": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match=r"'3.bias' has shape \(4,\)"):
        other.load_state_dict(bad)


def test_train_eval_reach_every_submodule_and_shared_parameters_count_once():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5)))
    model.eval()
    assert not any(m.training for _, m in model.named_modules())
    model.train()
    assert all(m.training for _, m in model.named_modules())
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    assert len(tied.parameters()) == 3


def test_sequential_backward_produces_gradients_in_reverse_parameter_order():
    model = mlp()
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: order.append(name))
    out = model.forward(np.ones((3, 4), dtype=np.float32))
    model.backward(np.ones_like(out))
    assert order == [n for n, _ in model.named_parameters()][::-1]


def test_sgd_momentum_and_weight_decay_follow_torch_rule():
    p = nn.Parameter(np.array([1.0, -2.0]))
    opt = nn.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    grads = [np.array([0.5, 0.5]), np.array([-1.0, 2.0])]
    data, buf = np.array([1.0, -2.0]), None
    for g in grads:
        p.grad = g.copy()
        opt.step()
        d = g + 0.01 * data
        buf = d if buf is None else 0.9 * buf + d
        data = data - 0.1 * buf
    np.testing.assert_allclose(p.data, data)


def test_adamw_matches_reference_formula_and_restores_state():
    rng = np.random.default_rng(0)
    p = nn.Parameter(rng.standard_normal(5))
    opt = nn.AdamW([p], lr=0.01, weight_decay=0.1)
    data, m, v = p.data.copy(), np.zeros(5), np.zeros(5)
    grads = [rng.standard_normal(5) for _ in range(3)]
    for t, g in enumerate(grads[:2], start=1):
        p.grad = g.copy()
        opt.step()
        data *= 1 - 0.01 * 0.1
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        data -= 0.01 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    np.testing.assert_allclose(p.data, data, rtol=1e-12)
    # a fresh optimizer restored from the state takes the same third step
    clone = nn.Parameter(p.data.copy())
    restored = nn.AdamW([clone], lr=0.01, weight_decay=0.1)
    restored.load_state_dict(opt.state_dict())
    for param, o in ((p, opt), (clone, restored)):
        param.grad = grads[2].copy()
        o.step()
    np.testing.assert_array_equal(p.data, clone.data)


def test_mlp_learns_a_small_classification_task():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 1)
    model, loss_fn = mlp(), nn.CrossEntropyLoss()
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(150):
        opt.zero_grad()
        loss = loss_fn.forward(model.forward(x), y)
        model.backward(loss_fn.backward())
        opt.step()
    model.eval()
    accuracy = (model.forward(x).argmax(axis=1) == y).mean()
    assert float(loss) < 0.2 and accuracy > 0.95


def test_to_casts_parameters_and_buffers():
    model = mlp().to(dtype=np.float64)
    assert all(p.data.dtype == np.float64 for p in model.parameters())
    assert model[1].running_mean.dtype == np.float64
    assert model[1].num_batches_tracked.dtype == np.int64
    assert model[1]._buffers["running_var"] is model[1].running_var


@pytest.mark.gpu
def test_layers_run_on_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no CUDA device: {exc}")
    model = nn.Sequential(
        nn.Linear(4, 8, rng=0),
        nn.LayerNorm(8),
        nn.GELU(),
        nn.BatchNorm1d(8),
        nn.Dropout(0.1, seed=0),
        nn.Linear(8, 3, rng=1),
    )
    x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    model.to("cuda")
    loss_fn = nn.CrossEntropyLoss()
    opt = nn.AdamW(model.parameters(), lr=0.01)
    loss_fn.forward(model.forward(cupy.asarray(x)), cupy.zeros(16, dtype=cupy.int64))
    model.backward(loss_fn.backward())
    opt.step()
    assert all(isinstance(p.grad, cupy.ndarray) for p in model.parameters())
    emb = nn.Embedding(10, 4).to("cuda")
    emb.forward(cupy.array([1, 1, 2]))
    emb.backward(cupy.ones((3, 4), dtype=cupy.float32))
    assert float(emb.weight.grad[1, 0]) == 2.0
    model.to("cpu")
    assert all(isinstance(p.data, np.ndarray) for p in model.parameters())


def test_reassigning_attributes_keeps_order_and_drops_what_is_replaced():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    model[0].bias = None
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "2.weight", "2.bias"]
    setattr(model, "1", nn.Tanh())  # what convert_sync_batchnorm does: same position
    assert [type(m).__name__ for m in model] == ["Linear", "Tanh", "Linear"]
