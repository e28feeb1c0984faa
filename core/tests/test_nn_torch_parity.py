"""pluribus.nn against PyTorch: forward values and gradients in float64 (rtol 1e-5), the GPT
and its parts, and each behaviour that a check against torch once found different.

Runs only where torch is installed (it is not a dependency of pluribus). The torch side is
written from torch's functional API, with the parameters taken by name from our modules, so
both sides compute from the same numbers.
"""

import math

import numpy as np
import pytest
from pluribus import nn
from pluribus.data import DistributedSampler

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = pytest.mark.timeout(120)

RTOL, ATOL = 1e-5, 1e-10


def as_torch(array, grad=True):
    tensor = torch.from_numpy(np.array(array, dtype=np.float64, copy=True))
    return tensor.requires_grad_(grad)


def torch_params(module):
    return {name: as_torch(p.data) for name, p in module.named_parameters()}


def assert_close(ours, theirs, name=""):
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else theirs
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, err_msg=name)


def compare(module, forward_torch, x, rng, input_grad=True):
    """Forward, input gradient and every parameter gradient of ``sum(out * w)``."""
    module.to(dtype=np.float64)
    module.zero_grad()
    params = torch_params(module)
    out = module.forward(x)
    weights = rng.standard_normal(out.shape)
    grad_x = module.backward(weights.copy())
    x_t = torch.from_numpy(x) if x.dtype.kind in "iu" else as_torch(x, grad=input_grad)
    out_t = forward_torch(x_t, params)
    assert_close(out, out_t, "forward")
    (out_t * torch.from_numpy(weights)).sum().backward()
    if input_grad:
        assert_close(grad_x, x_t.grad, "input gradient")
    for name, param in module.named_parameters():
        assert_close(param.grad, params[name].grad, name)


# -- layers ----------------------------------------------------------------------------------


def test_linear_layernorm_embedding_match_torch():
    rng = np.random.default_rng(0)
    compare(
        nn.Linear(5, 4, rng=0),
        lambda x, p: F.linear(x, p["weight"], p["bias"]),
        rng.standard_normal((2, 3, 5)),
        rng,
    )
    norm = nn.LayerNorm((3, 4))
    norm.weight.data[...] = rng.standard_normal((3, 4))
    norm.bias.data[...] = rng.standard_normal((3, 4))
    compare(
        norm,
        lambda x, p: F.layer_norm(x, (3, 4), p["weight"], p["bias"], 1e-5),
        rng.standard_normal((2, 3, 4)),
        rng,
    )
    compare(
        nn.Embedding(7, 3, rng=1),
        lambda idx, p: F.embedding(idx, p["weight"]),
        rng.integers(0, 7, (2, 5)),
        rng,
        input_grad=False,
    )


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_torch(approximate):
    rng = np.random.default_rng(1)
    x = np.concatenate([np.linspace(-8, 8, 33), rng.standard_normal(20)])
    compare(nn.GELU(approximate), lambda t, p: F.gelu(t, approximate=approximate), x, rng)
    assert nn.GELU().approximate == "none"  # torch's default


def test_batchnorm_training_matches_torch_including_running_statistics():
    rng = np.random.default_rng(2)
    bn = nn.BatchNorm1d(3)
    bn.weight.data[...] = rng.standard_normal(3)
    bn.to(dtype=np.float64)
    running = [torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)]
    compare(
        bn,
        lambda x, p: F.batch_norm(x, *running, p["weight"], p["bias"], True, 0.1, 1e-5),
        rng.standard_normal((6, 3, 4)),
        rng,
    )
    assert_close(bn.running_mean, running[0], "running_mean")
    assert_close(bn.running_var, running[1], "running_var")


def test_batchnorm_one_value_per_channel_raises_in_both():
    with pytest.raises(ValueError):
        F.batch_norm(torch.ones(1, 3), torch.zeros(3), torch.ones(3), training=True, momentum=0.1)
    with pytest.raises(ValueError, match="more than one value per channel"):
        nn.BatchNorm1d(3).forward(np.ones((1, 3), dtype=np.float32))


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_with_ignore_index_and_label_smoothing_matches_torch(smoothing):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 5))
    target = np.array([0, 4, -100, 2, -100, 1])
    loss = nn.CrossEntropyLoss(label_smoothing=smoothing)
    value = loss.forward(logits, target)
    grad = loss.backward()
    logits_t = as_torch(logits)
    value_t = F.cross_entropy(
        logits_t, torch.from_numpy(target), ignore_index=-100, label_smoothing=smoothing
    )
    value_t.backward()
    assert_close(value, value_t, "loss")
    assert_close(grad, logits_t.grad, "gradient")


def test_cross_entropy_label_outside_the_classes_raises_in_both():
    logits = np.zeros((2, 3))
    with pytest.raises((IndexError, RuntimeError)):
        F.cross_entropy(torch.from_numpy(logits), torch.tensor([0, -1]))
    with pytest.raises(IndexError):
        nn.CrossEntropyLoss().forward(logits, np.array([0, -1]))


# -- the transformer -------------------------------------------------------------------------


def torch_attention(x, p, prefix, n_head, fused):
    batch, time, channels = x.shape
    if fused:
        q, k, v = F.linear(x, p[prefix + "qkv.weight"], p[prefix + "qkv.bias"]).split(
            channels, dim=2
        )
    else:
        q, k, v = (
            F.linear(x, p[prefix + f"{n}.weight"], p[prefix + f"{n}.bias"])
            for n in ("query", "key", "value")
        )

    def heads(t):
        return t.reshape(batch, time, n_head, channels // n_head).transpose(1, 2)

    q, k, v = heads(q), heads(k), heads(v)
    scores = q @ k.transpose(-2, -1) / math.sqrt(channels // n_head)
    future = torch.ones(time, time, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    y = (weights @ v).transpose(1, 2).reshape(batch, time, channels)
    return F.linear(y, p[prefix + "proj.weight"], p[prefix + "proj.bias"])


def torch_block(x, p, prefix, n_head, fused, approximate):
    channels = x.shape[-1]

    def norm(t, name):
        return F.layer_norm(
            t, (channels,), p[prefix + name + ".weight"], p[prefix + name + ".bias"]
        )

    x = x + torch_attention(norm(x, "ln1"), p, prefix + "attn.", n_head, fused)
    h = F.linear(norm(x, "ln2"), p[prefix + "mlp.0.weight"], p[prefix + "mlp.0.bias"])
    h = F.gelu(h, approximate=approximate)
    return x + F.linear(h, p[prefix + "mlp.2.weight"], p[prefix + "mlp.2.bias"])


def torch_gpt(idx, p, config):
    time = idx.shape[1]
    x = F.embedding(idx, p["wte.weight"]) + F.embedding(torch.arange(time), p["wpe.weight"])
    for i in range(config.n_layer):
        x = torch_block(x, p, f"blocks.{i}.", config.n_head, config.fused_qkv, config.gelu)
    x = F.layer_norm(x, (config.n_embd,), p["ln_f.weight"], p["ln_f.bias"])
    return F.linear(x, p["wte.weight"] if config.tie_weights else p["head.weight"])


@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_attention_matches_torch(fused):
    rng = np.random.default_rng(4)
    compare(
        nn.CausalSelfAttention(8, 2, fused_qkv=fused, rng=0),
        lambda x, p: torch_attention(x, p, "", 2, fused),
        rng.standard_normal((2, 5, 8)),
        rng,
    )


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_transformer_block_matches_torch(approximate):
    rng = np.random.default_rng(5)
    compare(
        nn.TransformerBlock(8, 2, gelu=approximate, rng=1),
        lambda x, p: torch_block(x, p, "", 2, True, approximate),
        rng.standard_normal((2, 6, 8)),
        rng,
    )


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_weights": False, "fused_qkv": False, "gelu": "none"}],
    ids=["tied-fused-tanh", "untied-separate-exact"],
)
def test_gpt_matches_torch(overrides):
    rng = np.random.default_rng(6)
    config = nn.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, **overrides)
    compare(
        nn.GPT(config, rng=2),
        lambda idx, p: torch_gpt(idx, p, config),
        rng.integers(0, 11, (3, 7)),
        rng,
        input_grad=False,
    )


# -- optimizers, schedulers, samplers --------------------------------------------------------


def test_sgd_momentum_weight_decay_on_a_0d_parameter_matches_torch():
    ours = nn.Parameter(np.array(1.0))
    opt = nn.SGD([ours], lr=0.1, momentum=0.9, weight_decay=0.1)
    theirs = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    opt_t = torch.optim.SGD([theirs], lr=0.1, momentum=0.9, weight_decay=0.1)
    for _ in range(4):
        ours.grad = 2 * ours.data.copy()
        opt.step()
        opt_t.zero_grad()
        (theirs * theirs).backward()
        opt_t.step()
        assert_close(ours.data, theirs)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_on_arrays_matches_torch(nesterov):
    rng = np.random.default_rng(7)
    start = rng.standard_normal((3, 2))
    ours = nn.Parameter(start.copy())
    opt = nn.SGD([ours], lr=0.05, momentum=0.8, weight_decay=0.01, nesterov=nesterov)
    theirs = as_torch(start)
    opt_t = torch.optim.SGD([theirs], lr=0.05, momentum=0.8, weight_decay=0.01, nesterov=nesterov)
    for step in range(5):
        grad = rng.standard_normal((3, 2))
        ours.grad = grad.copy()
        theirs.grad = torch.from_numpy(grad.copy())
        opt.step()
        opt_t.step()
        assert_close(ours.data, theirs, f"step {step}")


def test_adamw_resumed_through_its_state_dict_matches_torch_uninterrupted():
    rng = np.random.default_rng(8)
    start = rng.standard_normal(4)
    grads = rng.standard_normal((6, 4))
    theirs = as_torch(start)
    opt_t = torch.optim.AdamW([theirs], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    ours = nn.Parameter(start.copy())
    opt = nn.AdamW([ours], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    for step, grad in enumerate(grads):
        if step == 3:  # a restart: a fresh optimizer loads the saved state
            saved = opt.state_dict()
            opt = nn.AdamW([ours], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
            opt.load_state_dict(saved)
        ours.grad = grad.copy()
        theirs.grad = torch.from_numpy(grad.copy())
        opt.step()
        opt_t.step()
        assert_close(ours.data, theirs, f"step {step}")


def test_param_groups_and_lambda_lr_match_torch():
    rng = np.random.default_rng(9)
    starts = [rng.standard_normal(3), rng.standard_normal(2)]
    ours = [nn.Parameter(s.copy()) for s in starts]
    theirs = [as_torch(s) for s in starts]

    def schedule(step):
        return 0.5 ** (step // 2)

    opt = nn.SGD([{"params": [ours[0]]}, {"params": [ours[1]], "lr": 0.3}], lr=0.1, momentum=0.9)
    opt_t = torch.optim.SGD(
        [{"params": [theirs[0]]}, {"params": [theirs[1]], "lr": 0.3}], lr=0.1, momentum=0.9
    )
    sched, sched_t = nn.LambdaLR(opt, schedule), torch.optim.lr_scheduler.LambdaLR(opt_t, schedule)
    for _ in range(5):
        for p, p_t in zip(ours, theirs, strict=True):
            grad = rng.standard_normal(p.data.shape)
            p.grad, p_t.grad = grad.copy(), torch.from_numpy(grad.copy())
        opt.step()
        opt_t.step()
        sched.step()
        sched_t.step()
        assert sched.get_last_lr() == pytest.approx(sched_t.get_last_lr(), rel=1e-15)
        for p, p_t in zip(ours, theirs, strict=True):
            assert_close(p.data, p_t)


def test_a_parameter_without_gradient_is_left_alone_as_in_torch():
    """What DDP with find_unused_parameters must reproduce: torch's SGD skips a parameter
    whose gradient is None, so weight decay and momentum do not move it."""
    rng = np.random.default_rng(10)
    trunk, branch = nn.Linear(3, 2, rng=0), nn.Linear(2, 2, rng=1)
    trunk.to(dtype=np.float64)
    branch.to(dtype=np.float64)
    params = trunk.parameters() + branch.parameters()
    params_t = [as_torch(p.data) for p in params]
    opt = nn.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    opt_t = torch.optim.SGD(params_t, lr=0.1, momentum=0.9, weight_decay=0.1)
    for step in range(4):
        x = rng.standard_normal((4, 3))
        use_branch = step == 0
        out = trunk.forward(x)
        out_t = F.linear(torch.from_numpy(x), params_t[0], params_t[1])
        if use_branch:
            out = branch.forward(out)
            out_t = F.linear(out_t, params_t[2], params_t[3])
        g = out / out.size  # d(0.5 * mean of squares)
        trunk.backward(branch.backward(g) if use_branch else g)
        (0.5 * (out_t**2).sum() / out_t.numel()).backward()
        opt.step()
        opt.zero_grad()
        opt_t.step()
        opt_t.zero_grad()
        for p, p_t in zip(params, params_t, strict=True):
            assert_close(p.data, p_t, f"step {step}")


def test_distributed_sampler_takes_a_dataset_and_orders_like_torch_without_shuffle():
    from torch.utils.data import DistributedSampler as TorchSampler

    dataset = list(range(11))
    for world in (2, 3, 4):
        for drop_last in (False, True):
            for rank in range(world):
                ours = DistributedSampler(dataset, world, rank, shuffle=False, drop_last=drop_last)
                theirs = TorchSampler(dataset, world, rank, shuffle=False, drop_last=drop_last)
                assert ours.indices().tolist() == list(theirs)
                assert len(ours) == len(theirs)
