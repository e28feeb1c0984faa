"""The small GPT and what the parallel layers need from modules: gradients against finite
differences in float64, split backward, hooks, activation checkpointing, memory accounting."""

import mmap

import numpy as np
import pytest
from pluribus import nn
from test_nn_gradients import numerical_grad

pytestmark = pytest.mark.timeout(120)

VOCAB, CONTEXT = 11, 6


def tiny_config(**overrides):
    sizes = dict(vocab_size=VOCAB, block_size=CONTEXT, n_layer=2, n_head=2, n_embd=8)
    return nn.GPTConfig(**{**sizes, **overrides})


def tokens(rng, batch=2, time=5):
    return rng.integers(0, VOCAB, (batch, time))


def check_gradients(module, inputs, rng, *, input_grad=True, atol=1e-6, rtol=1e-5):
    """Backward of ``sum(forward(inputs) * w)`` against central differences, in float64."""
    module.to(dtype=np.float64)
    weights = rng.standard_normal(module.forward(inputs).shape)

    def loss():
        value = float((module.forward(inputs) * weights).sum())
        module.release_saved()
        return value

    module.zero_grad()
    module.forward(inputs)
    grad_input = module.backward(weights.copy())
    if input_grad:
        np.testing.assert_allclose(
            grad_input, numerical_grad(loss, inputs), atol=atol, rtol=rtol, err_msg="input"
        )
    for name, param in module.named_parameters():
        expected = numerical_grad(loss, param.data)
        np.testing.assert_allclose(param.grad, expected, atol=atol, rtol=rtol, err_msg=name)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_attention_gradients_match_finite_differences(fused):
    rng = np.random.default_rng(0)
    attn = nn.CausalSelfAttention(8, 2, fused_qkv=fused, rng=1)
    check_gradients(attn, rng.standard_normal((2, 5, 8)), rng)


def test_attention_is_causal_and_each_head_is_softmax_attention():
    rng = np.random.default_rng(1)
    attn = nn.CausalSelfAttention(8, 2, fused_qkv=False, rng=2).to(dtype=np.float64)
    x = rng.standard_normal((1, 4, 8))
    out = attn.forward(x)
    changed = x.copy()
    changed[0, 3] += 1.0  # the last position must not change the earlier outputs
    np.testing.assert_allclose(attn.forward(changed)[0, :3], out[0, :3], rtol=1e-13)
    q, k, v = (x[0] @ m.weight.data.T + m.bias.data for m in (attn.query, attn.key, attn.value))
    heads = []
    for h in range(2):
        cols = slice(4 * h, 4 * h + 4)
        scores = q[:, cols] @ k[:, cols].T / 2.0 + np.triu(np.full((4, 4), -np.inf), 1)
        probs = np.exp(scores - scores.max(axis=1, keepdims=True))
        heads.append(probs / probs.sum(axis=1, keepdims=True) @ v[:, cols])
    expected = np.concatenate(heads, axis=1) @ attn.proj.weight.data.T + attn.proj.bias.data
    np.testing.assert_allclose(out[0], expected, rtol=1e-12)


def test_transformer_block_gradients_match_finite_differences():
    rng = np.random.default_rng(2)
    block = nn.TransformerBlock(8, 2, gelu="none", rng=3)
    check_gradients(block, rng.standard_normal((2, 4, 8)), rng)


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "untied-head"])
def test_gpt_gradients_match_finite_differences(tied):
    rng = np.random.default_rng(3)
    model = nn.GPT(tiny_config(n_layer=1, tie_weights=tied), rng=4)
    names = [n for n, _ in model.named_parameters()]
    assert ("head.weight" in names) is not tied
    check_gradients(model, tokens(rng), rng, input_grad=False)


def test_gpt_refuses_contexts_longer_than_its_block():
    model = nn.GPT(tiny_config(), rng=0)
    with pytest.raises(ValueError, match="block_size is 6"):
        model.forward(np.zeros((1, 7), dtype=np.int64))


def _grads(model):
    return {n: p.grad.copy() for n, p in model.named_parameters()}


def _split_equals_plain(make, inputs, rng, input_grad=True):
    model = make()
    out = model.forward(inputs)
    grad_output = rng.standard_normal(out.shape).astype(out.dtype)
    plain_input = model.backward(grad_output)
    plain = _grads(model)
    model.zero_grad()
    model.forward(inputs)
    split_input = model.backward_input(grad_output)
    assert all(p.grad is None for p in model.parameters()), "weights waited for backward_weight"
    model.backward_weight()
    if input_grad:
        np.testing.assert_array_equal(split_input, plain_input)
    for name, grad in _grads(model).items():
        np.testing.assert_array_equal(grad, plain[name], err_msg=name)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Linear(5, 4, rng=0), (3, 5)),
        (lambda: nn.LayerNorm((2, 3)), (4, 2, 3)),
        (lambda: nn.BatchNorm1d(3), (6, 3)),
        (lambda: nn.Sequential(nn.Linear(5, 6, rng=1), nn.GELU(), nn.Linear(6, 2, rng=2)), (4, 5)),
        (lambda: nn.CausalSelfAttention(8, 2, fused_qkv=False, rng=0), (2, 5, 8)),
        (lambda: nn.TransformerBlock(8, 2, rng=0), (2, 5, 8)),
        (lambda: nn.Checkpoint(nn.TransformerBlock(8, 2, rng=0)), (2, 5, 8)),
    ],
    ids=["linear", "layernorm", "batchnorm", "sequential", "attention", "block", "checkpoint"],
)
def test_split_backward_equals_plain_backward_exactly(make, shape):
    rng = np.random.default_rng(5)
    _split_equals_plain(make, rng.standard_normal(shape).astype(np.float32), rng)


def test_split_backward_of_the_gpt_equals_plain_exactly_with_tied_weights():
    rng = np.random.default_rng(6)
    _split_equals_plain(lambda: nn.GPT(tiny_config(), rng=7), tokens(rng), rng, input_grad=False)


def test_a_module_with_weights_and_no_split_backward_says_so():
    class Opaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(np.ones(2))

        def backward(self, grad_output):
            return grad_output

    with pytest.raises(NotImplementedError, match="Opaque has parameters but no split backward"):
        Opaque().backward_input(np.ones(2))
    assert nn.ReLU().backward_weight() is None  # nothing to defer without weights


def test_forward_and_backward_hooks_run_on_a_child_its_parent_calls():
    """What FSDP needs: a unit's hooks run wherever it is called from, in torch's order."""
    model = nn.Sequential(nn.Linear(3, 4, rng=0), nn.Tanh(), nn.Linear(4, 2, rng=1))
    events = []
    unit = model[2]
    handles = [
        unit.register_forward_pre_hook(lambda m, args: events.append(("pre", args[0].shape))),
        unit.register_forward_hook(lambda m, args, out: events.append(("post", out.shape))),
        unit.register_full_backward_pre_hook(lambda m, g: events.append(("bpre", g[0].shape))),
        unit.register_full_backward_hook(
            lambda m, gi, go: events.append(("bpost", gi[0].shape, go[0].shape))
        ),
    ]
    x = np.ones((5, 3), dtype=np.float32)
    out = model.forward(x)
    model.backward(np.ones_like(out))
    assert events == [
        ("pre", (5, 4)),
        ("post", (5, 2)),
        ("bpre", (5, 2)),
        ("bpost", (5, 4), (5, 2)),
    ]
    events.clear()
    model.forward(x)
    model.backward_input(np.ones_like(out))  # split backward runs the backward hooks once
    model.backward_weight()
    assert [e[0] for e in events] == ["pre", "post", "bpre", "bpost"]
    for handle in handles:
        handle.remove()
    events.clear()
    model.forward(x)
    model.backward(np.ones_like(out))
    assert events == []


def test_hooks_can_replace_inputs_outputs_and_gradients():
    layer = nn.Linear(2, 2, bias=False, rng=0)
    layer.weight.data[...] = np.eye(2)
    layer.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    layer.register_forward_hook(lambda m, args, out: out + 1)
    layer.register_full_backward_pre_hook(lambda m, g: (g[0] * 3,))
    layer.register_full_backward_hook(lambda m, gi, go: (gi[0] * 5,))
    x = np.ones((1, 2), dtype=np.float32)
    np.testing.assert_array_equal(layer(x), [[3, 3]])
    np.testing.assert_array_equal(layer.backward(np.ones((1, 2), np.float32)), [[15, 15]])
    np.testing.assert_array_equal(layer.weight.grad, [[6, 6], [6, 6]])  # 3 * dy outer 2 x


def test_prepend_runs_a_hook_before_those_registered_earlier():
    """torch's ``prepend=True``, on each of the four hook lists: order shows in the arithmetic
    (first add, then multiply, or the other way round)."""
    layer = nn.Linear(1, 1, bias=False, rng=0)
    layer.weight.data[...] = 1
    layer.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    layer.register_forward_pre_hook(lambda m, args: (args[0] + 1,), prepend=True)
    layer.register_forward_hook(lambda m, args, out: out * 3)
    layer.register_forward_hook(lambda m, args, out: out + 1, prepend=True)
    layer.register_full_backward_pre_hook(lambda m, g: (g[0] * 5,))
    layer.register_full_backward_pre_hook(lambda m, g: (g[0] + 1,), prepend=True)
    layer.register_full_backward_hook(lambda m, gi, go: (gi[0] * 7,))
    layer.register_full_backward_hook(lambda m, gi, go: (gi[0] + 1,), prepend=True)
    x = np.ones((1, 1), dtype=np.float32)
    np.testing.assert_array_equal(layer(x), [[((1 + 1) * 2 + 1) * 3]])
    np.testing.assert_array_equal(layer.backward(np.ones((1, 1), np.float32)), [[(10 + 1) * 7]])


def test_hooks_with_kwargs_see_and_replace_keyword_arguments():
    """torch's ``with_kwargs=True``: a pre hook gets ``(module, args, kwargs)`` and may return
    ``(args, kwargs)``; a forward hook gets ``(module, args, kwargs, output)``; removing the
    handle removes the hook; a pre hook that returns anything else is refused by name."""

    class Scaled(nn.Module):
        def forward(self, x, *, scale=1.0):
            return x * scale

    layer, seen = Scaled(), []
    layer.register_forward_pre_hook(lambda m, args: (args[0] + 1,))  # without kwargs, mixed in
    handle = layer.register_forward_pre_hook(
        lambda m, args, kwargs: (args, {**kwargs, "scale": kwargs["scale"] * 10}), with_kwargs=True
    )
    layer.register_forward_hook(
        lambda m, args, kwargs, out: seen.append((args, dict(kwargs))) or out - 1, with_kwargs=True
    )
    assert layer(np.float64(2.0), scale=3.0) == (2 + 1) * 30 - 1
    assert seen == [((3.0,), {"scale": 30.0})]
    handle.remove()
    assert layer(np.float64(2.0), scale=3.0) == (2 + 1) * 3 - 1
    layer.register_forward_pre_hook(lambda m, args, kwargs: args, with_kwargs=True)
    with pytest.raises(RuntimeError, match=r"with_kwargs=True returned tuple; it must return"):
        layer(np.float64(2.0), scale=3.0)


def test_a_subclass_calling_super_forward_runs_its_hooks_once():
    class Shifted(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1

    layer, calls = Shifted(2, 2, rng=0), []
    layer.register_forward_hook(lambda m, args, out: calls.append(out.copy()))
    out = layer.forward(np.ones((1, 2), dtype=np.float32))
    assert len(calls) == 1
    np.testing.assert_array_equal(calls[0], out)


def test_checkpoint_keeps_only_the_input_and_gives_the_same_gradients():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 6, 16)).astype(np.float32)
    g = rng.standard_normal((4, 6, 16)).astype(np.float32)
    plain = nn.TransformerBlock(16, 4, dropout=0.2, rng=9)
    wrapped = nn.Checkpoint(nn.TransformerBlock(16, 4, dropout=0.2, rng=9))
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    out_plain, out_wrapped = plain.forward(x), wrapped.forward(x)
    np.testing.assert_array_equal(out_wrapped, out_plain)
    held_plain = nn.memory_report(plain).activations
    held_wrapped = nn.memory_report(wrapped).activations
    assert held_wrapped == x.nbytes  # the input, nothing else
    assert held_plain > 10 * x.nbytes
    np.testing.assert_array_equal(wrapped.backward(g), plain.backward(g))  # same dropout masks
    for name, grad in _grads(plain).items():
        np.testing.assert_array_equal(dict(wrapped.named_parameters())[name].grad, grad, name)
    assert nn.memory_report(wrapped).activations == 0


def test_memory_report_counts_each_buffer_once():
    model = nn.GPT(tiny_config(), rng=0)
    opt = nn.AdamW(model.parameters())
    param_bytes = sum(p.data.nbytes for p in model.parameters())
    before = nn.memory_report(model, opt)
    assert before.parameters == param_bytes  # the tied head is not counted twice
    assert before.gradients == before.optimizer_state == before.activations == 0
    out = model.forward(tokens(np.random.default_rng(0)))
    assert nn.memory_report(model).activations > out.nbytes
    model.backward(np.ones_like(out))
    opt.step()
    after = nn.memory_report(model, opt)
    assert after.gradients == param_bytes
    step_counters = 8 * len(model.parameters())
    assert after.optimizer_state == 2 * param_bytes + step_counters
    assert after.activations == 0  # backward released what forward kept
    assert after.peak_rss >= after.total
    assert "parameters" in str(after)


def test_memory_report_counts_an_array_made_from_a_larger_buffer_as_itself():
    """As a symmetric array is: made from a memoryview of a segment holding every rank's."""
    segment = mmap.mmap(-1, 4 * 4096)
    mine = np.frombuffer(segment, np.float32, count=1024, offset=4096)
    model = nn.Linear(32, 32, rng=0)
    model.weight.grad = mine.reshape(32, 32)
    assert nn.memory_report(model).gradients == mine.nbytes == 4096


def test_gpt_learns_to_copy_a_repeating_sequence():
    rng = np.random.default_rng(0)
    model = nn.GPT(tiny_config(n_embd=16), rng=1)
    opt, loss_fn = nn.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0), nn.CrossEntropyLoss()
    start = rng.integers(0, VOCAB, (32, 1))
    seq = (start + np.arange(CONTEXT + 1)) % VOCAB  # next token = this token + 1
    x, y = seq[:, :-1], seq[:, 1:]
    for _ in range(60):
        logits = model.forward(x)
        loss = float(loss_fn.forward(logits.reshape(-1, VOCAB), y.reshape(-1)))
        model.backward(loss_fn.backward().reshape(logits.shape))
        opt.step()
        opt.zero_grad()
    assert loss < 0.1
    sample = model.generate(np.array([[3]]), 5, temperature=0.01, rng=0)
    np.testing.assert_array_equal(sample, [[3, 4, 5, 6, 7, 8]])
