"""Tensor parallelism: a split transformer block gives the unsplit block's outputs and
gradients (threads and gloo, 2 and 4 ranks), with one all-reduce per MLP and attention in each
direction; a 2-D (dp x tp) GPT training run equals one process."""

from __future__ import annotations

import copy

import numpy as np
import pluribus as pb
import pytest
from dtensor_helpers import CountingPlugin
from hypothesis import given, settings
from hypothesis import strategies as st
from pluribus import checkpoint, nn
from pluribus.dtensor import Partial, Replicate, Shard, init_device_mesh, split_sizes
from pluribus.parallel import (
    AttentionParallel,
    ColwiseParallel,
    DistributedDataParallel,
    RowwiseParallel,
    clip_grad_norm_,
    full_parameter,
    fully_shard,
    get_model_state_dict,
    get_optimizer_state_dict,
    parallelize_module,
    transformer_plan,
)
from pluribus.testing import RanksFailed, run_ranks


def _block_parity(fused: bool, counting: CountingPlugin | None):
    mesh = init_device_mesh("cpu", (pb.get_world_size(),), mesh_dim_names=("tp",))
    block = nn.TransformerBlock(32, 4, fused_qkv=fused, dtype=np.float64, rng=1)
    reference = copy.deepcopy(block)
    parallelize_module(block, mesh, transformer_plan(block))
    rng = np.random.default_rng(2)
    x, grad = rng.normal(size=(2, 5, 32)), rng.normal(size=(2, 5, 32))
    want_y, want_gx = reference.forward(x), None
    want_gx = reference.backward(grad)
    mark = counting.mark(pb.get_rank()) if counting else 0
    y = block.forward(x)
    gx = block.backward(grad)
    if counting:
        issued = [c[0] for c in counting.since(pb.get_rank(), mark)]
        # mlp and attention, forward and backward, each leaving its partial sums as they were
        assert issued == ["all_reduce_into"] * 4, issued
    np.testing.assert_allclose(y, want_y, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gx, want_gx, rtol=1e-10, atol=1e-12)
    shapes = {}
    for (name, p), (_, q) in zip(
        block.named_parameters(), reference.named_parameters(), strict=True
    ):
        shapes[name] = p.data.shape
        np.testing.assert_array_equal(full_parameter(p), q.data, err_msg=name)
        np.testing.assert_allclose(
            full_parameter(p, grad=True), q.grad, rtol=1e-10, atol=1e-12, err_msg=name
        )
    return shapes


@pytest.fixture
def counting():
    plugin = CountingPlugin()
    manager = pb.get_plugin_manager()
    manager.register(plugin, name="test-tp-counting")
    yield plugin
    manager.unregister(name="test-tp-counting")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fused", [True, False])
def test_split_block_equals_the_block_on_threads(world, fused, counting):
    shapes = run_ranks(_block_parity, world, args=(fused, counting))[0]
    assert shapes["mlp.0.weight"] == (128 // world, 32)
    assert shapes["mlp.2.weight"] == (32, 128 // world)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_split_block_equals_the_block_on_gloo(world):
    pb_ = pytest.importorskip("pluribus_gloo")
    del pb_
    run_ranks(_block_parity, world, backend="gloo", args=(True, None), timeout=100)


def _linear_layouts(batch: int):
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rng = np.random.default_rng(3)
    first, second = (
        nn.Linear(6, 5, dtype=np.float64, rng=4),
        nn.Linear(5, 3, dtype=np.float64, rng=5),
    )
    ref1, ref2 = copy.deepcopy(first), copy.deepcopy(second)
    # a gathered column-parallel output, then a row-parallel layer slicing it (5 over 2: 3, 2),
    # scattering its output over the batch (sequence parallel)
    parallelize_module(first, mesh, ColwiseParallel(output_layouts=pb_replicate()))
    parallelize_module(
        second, mesh, RowwiseParallel(input_layouts=pb_replicate(), output_layouts=Shard(0))
    )
    x, g = rng.normal(size=(batch, 6)), rng.normal(size=(batch, 3))
    y = second.forward(first.forward(x))
    want = ref2.forward(ref1.forward(x))
    mine = np.array_split(np.arange(batch), mesh.size())[mesh.get_local_rank()]  # 5: 3, 2
    np.testing.assert_allclose(y, want[mine], rtol=1e-12)
    gx = first.backward(second.backward(g[mine]))
    np.testing.assert_allclose(gx, ref1.backward(ref2.backward(g)), rtol=1e-10)
    for p, q in [
        (first.weight, ref1.weight),
        (second.weight, ref2.weight),
        (second.bias, ref2.bias),
    ]:
        np.testing.assert_allclose(full_parameter(p, grad=True), q.grad, rtol=1e-10)
    return True


def pb_replicate():
    from pluribus.dtensor import Replicate

    return Replicate()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch", [4, 5])
def test_linear_styles_with_gathered_and_scattered_layouts_and_uneven_features(batch):
    assert run_ranks(_linear_layouts, 2, args=(batch,)) == [True, True]


def _batch_sharded_input_and_empty_pieces():
    """A column-parallel layer taking the batch sharded unevenly (its sizes learned from the
    ranks, never guessed), and an MLP whose 2 hidden features leave one of 3 ranks none."""
    from pluribus.parallel import MLPParallel

    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rng = np.random.default_rng(8)
    mine = np.array_split(np.arange(7), mesh.size())[mesh.get_local_rank()]  # 3, 2, 2
    layer = nn.Linear(4, 5, dtype=np.float64, rng=9)
    reference = copy.deepcopy(layer)
    parallelize_module(
        layer, mesh, ColwiseParallel(input_layouts=Shard(0), output_layouts=pb_replicate())
    )
    x, g = rng.normal(size=(7, 4)), rng.normal(size=(7, 5))
    np.testing.assert_allclose(layer.forward(x[mine]), reference.forward(x), rtol=1e-12)
    np.testing.assert_allclose(layer.backward(g), reference.backward(g)[mine], rtol=1e-10)
    np.testing.assert_allclose(full_parameter(layer.weight, grad=True), reference.weight.grad)
    mlp = nn.Sequential(
        nn.Linear(4, 2, dtype=np.float64, rng=10),
        nn.ReLU(),
        nn.Linear(2, 4, dtype=np.float64, rng=11),
    )
    reference = copy.deepcopy(mlp)
    parallelize_module(mlp, mesh, MLPParallel())
    x, g = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    np.testing.assert_allclose(mlp.forward(x), reference.forward(x), rtol=1e-12)
    np.testing.assert_allclose(mlp.backward(g), reference.backward(g), rtol=1e-10, atol=1e-15)
    return True


def _features_sharded_output(out_features: int):
    """A row-parallel layer whose output stays split by features (reduce-scatter of the last
    dimension): each rank adds its own features' bias."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    layer = nn.Linear(4, out_features, dtype=np.float64, rng=12)
    reference = copy.deepcopy(layer)
    parallelize_module(
        layer, mesh, RowwiseParallel(input_layouts=pb_replicate(), output_layouts=Shard(-1))
    )
    rng = np.random.default_rng(13)
    x, g = rng.normal(size=(5, 4)), rng.normal(size=(5, out_features))
    mine = np.array_split(np.arange(out_features), mesh.size())[mesh.get_local_rank()]
    np.testing.assert_allclose(layer.forward(x), reference.forward(x)[:, mine], rtol=1e-12)
    np.testing.assert_allclose(layer.backward(g[:, mine]), reference.backward(g), rtol=1e-10)
    np.testing.assert_allclose(layer.bias.grad, reference.bias.grad, rtol=1e-12)
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, out_features", [(2, 4), (2, 2), (3, 4)])
def test_features_sharded_output_adds_each_rank_its_bias(world, out_features):
    assert run_ranks(_features_sharded_output, world, args=(out_features,)) == [True] * world


def _pieces_not_array_split():
    mesh = init_device_mesh("cpu", (2,))
    layer = nn.Linear(4, 5, dtype=np.float64, rng=9)
    parallelize_module(
        layer, mesh, ColwiseParallel(input_layouts=Shard(0), output_layouts=pb_replicate())
    )
    layer.forward(np.zeros(([1, 4][pb.get_rank()], 4)))  # array_split would be 3, 2


@pytest.mark.timeout(60)
def test_batch_pieces_other_than_array_split_are_refused_on_every_rank():
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_pieces_not_array_split, 2)
    assert sorted(e.rank for e in failed.value.errors) == [0, 1]
    for e in failed.value.errors:
        assert e.kind == "ValueError" and "(3, 2) rows for the ranks" in e.message, e.message
        assert "got (1, 4)" in e.message


@pytest.mark.timeout(60)
def test_batch_sharded_unevenly_and_ranks_without_features():
    assert run_ranks(_batch_sharded_input_and_empty_pieces, 3) == [True] * 3


def _bad_heads():
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    parallelize_module(
        nn.TransformerBlock(24, 3, rng=0), mesh, transformer_plan(nn.TransformerBlock(24, 3, rng=0))
    )


@pytest.mark.timeout(60)
def test_heads_that_do_not_split_are_refused_on_every_rank():
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_bad_heads, 2)
    assert [e.rank for e in failed.value.errors] == [0, 1]
    assert all("3 heads do not split evenly over 2 ranks" in e.message for e in failed.value.errors)


def _clip_whole(parameters, max_norm: float, norm_type: float) -> float:
    """The oracle: clipping whole gradients in one process, by the formula."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if np.isinf(norm_type):
        norm = max(float(np.abs(g).max()) for g in grads)
    else:
        norm = sum(float((np.abs(g) ** norm_type).sum()) for g in grads) ** (1 / norm_type)
    if norm > max_norm:
        for g in grads:
            g *= max_norm / (norm + 1e-6)
    return norm


def _train_gpt(
    dp: int,
    tp: int,
    steps: int,
    clip: tuple[float, float] | None = None,
    fsdp: bool = False,
    path: str = "",
):
    """A GPT trained on a dp x tp mesh (DDP or, with ``fsdp``, FSDP over dp, its whole
    parameters read back from a checkpoint at ``path``), or alone."""
    config = nn.GPTConfig(vocab_size=32, n_layer=2, n_head=4, n_embd=32, block_size=8)
    model = nn.GPT(config, dtype=np.float64, rng=0)
    shapes = {n: p.data.shape for n, p in model.named_parameters()}
    rank = pb.get_rank() if pb.is_initialized() else 0
    data = np.random.default_rng(5).integers(0, 32, size=(steps, 4, 9))
    if dp * tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], transformer_plan(model))
        if fsdp:
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            wrapped = fully_shard(model, mesh=mesh["dp"])
        else:
            wrapped = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
        me = mesh.get_local_rank("dp")
    else:
        wrapped, me = model, 0
    opt = nn.AdamW(model.parameters(), lr=1e-2)
    loss_fn = nn.CrossEntropyLoss()
    losses, norms = [], []
    per = 4 // dp
    for step in range(steps):
        batch = data[step, per * me : per * (me + 1)]
        logits = wrapped.forward(batch[:, :-1])
        loss = loss_fn.forward(logits.reshape(-1, 32), batch[:, 1:].reshape(-1))
        wrapped.backward(loss_fn.backward().reshape(logits.shape))
        if clip is not None and fsdp:
            norms.append(wrapped.clip_grad_norm_(*clip))
        elif clip is not None:
            clipping = clip_grad_norm_ if dp * tp > 1 else _clip_whole
            norms.append(clipping(model.parameters(), *clip))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    del rank
    if fsdp:  # the state dict's pieces saved, read back whole (the q, k, v blocks merged)
        checkpoint.save(get_model_state_dict(wrapped), path)
        state = checkpoint.read_whole(path)
        params = {n: state[n].reshape(shapes[n]) for n in shapes}
    else:
        params = {n: full_parameter(p) for n, p in model.named_parameters()}
    return (losses, params, norms) if clip is not None else (losses, params)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp-tp", "fsdp-tp"])
@pytest.mark.parametrize("norm_type", [2.0, np.inf])
def test_gradient_clipping_of_a_split_model_equals_one_process(norm_type, fsdp, tmp_path):
    clip = (0.05, norm_type)
    want_losses, want_params, want_norms = _train_gpt(1, 1, 3, clip)
    assert min(want_norms) > 0.05  # every step clips
    args = (2, 2, 3, clip, fsdp, str(tmp_path / "c"))
    for _, params, norms in run_ranks(_train_gpt, 4, args=args):
        np.testing.assert_allclose(norms, want_norms, rtol=1e-9)
        for name, value in params.items():
            np.testing.assert_allclose(value, want_params[name], rtol=1e-7, atol=1e-9, err_msg=name)


def _clip_with_empty_pieces(world: int):
    """Hidden size 3 over 4 ranks: one rank's pieces of the split weights are empty, and it
    still takes part in the norm's all-reduce."""
    from pluribus.parallel import MLPParallel

    model = nn.Sequential(
        nn.Linear(4, 3, dtype=np.float64, rng=1),
        nn.Tanh(),
        nn.Linear(3, 2, dtype=np.float64, rng=2),
    )
    if world > 1:
        parallelize_module(model, init_device_mesh("cpu", (world,)), MLPParallel())
    x = np.random.default_rng(3).normal(size=(5, 4))
    model.backward(np.ones_like(model.forward(x)))
    clipping = clip_grad_norm_ if world > 1 else _clip_whole
    norm = clipping(model.parameters(), 0.1, 2.0)
    return norm, {n: full_parameter(p, grad=True) for n, p in model.named_parameters()}


def test_gradient_clipping_with_empty_pieces_equals_one_process():
    want_norm, want_grads = _clip_with_empty_pieces(1)
    for norm, grads in run_ranks(_clip_with_empty_pieces, 4, args=(4,), timeout=30):
        assert norm == pytest.approx(want_norm, rel=1e-12)
        for name, value in grads.items():
            np.testing.assert_allclose(value, want_grads[name], rtol=1e-12, err_msg=name)


def _clip_of_fsdp():
    from pluribus.parallel import fully_shard

    model = fully_shard(nn.Linear(4, 4, rng=0))
    try:
        clip_grad_norm_(model.parameters(), 1.0)
    except ValueError as e:
        return str(e)


def test_gradient_clipping_refuses_fsdp_parameters():
    for rank, error in enumerate(run_ranks(_clip_of_fsdp, 2)):
        assert error == (
            f"rank {rank}: clip_grad_norm_ got a parameter that FSDP shards; use the FSDP "
            "model's own model.clip_grad_norm_(max_norm)"
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp-tp", "fsdp-tp"])
def test_dp_by_tp_training_equals_one_process(fsdp, tmp_path):
    want_losses, want_params = _train_gpt(1, 1, 4)
    results = run_ranks(_train_gpt, 4, args=(2, 2, 4, None, fsdp, str(tmp_path / "c")))
    for losses, params in results:
        # each dp rank sees half the batch: the mean of the two halves' losses is the whole's
        assert len(losses) == 4
        for name, value in params.items():
            np.testing.assert_allclose(value, want_params[name], rtol=1e-7, atol=1e-9, err_msg=name)
    for step in range(4):
        mean = (results[0][0][step] + results[2][0][step]) / 2
        assert mean == pytest.approx(want_losses[step], rel=1e-9)


def _sequence_parallel_gpt(n_layer: int, tokens: int):
    """A GPT split with sequence parallelism over the world, its unsplit copy, a batch of
    ``tokens`` tokens and a gradient for the logits."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    config = nn.GPTConfig(vocab_size=32, n_layer=n_layer, n_head=4, n_embd=32, block_size=8)
    model = nn.GPT(config, dtype=np.float64, rng=0)
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, transformer_plan(model, sequence_parallel=True))
    idx = np.random.default_rng(6).integers(0, 32, size=(2, tokens))
    grad = np.random.default_rng(7).normal(size=(2, tokens, 32))
    return model, reference, idx, grad


def _gpt_sequence_parallel(counting: CountingPlugin, tokens: int):
    model, reference, idx, grad = _sequence_parallel_gpt(2, tokens)
    want = reference.forward(idx)
    reference.backward(grad)
    mark = counting.mark(pb.get_rank())
    np.testing.assert_allclose(model.forward(idx), want, rtol=1e-10, atol=1e-12)
    model.backward(grad)
    kinds = [c[0] for c in counting.since(pb.get_rank(), mark)]
    assert (
        "all_reduce_into" in kinds and "reduce_scatter" in kinds
    )  # the norms' gradients; the blocks
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        np.testing.assert_allclose(
            full_parameter(p, grad=True), q.grad, rtol=1e-9, atol=1e-12, err_msg=name
        )
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, tokens", [(2, 8), (4, 8), (4, 7)])  # 7 over 4: 2, 2, 2, 1
def test_sequence_parallel_gpt_equals_the_gpt(world, tokens, counting):
    assert run_ranks(_gpt_sequence_parallel, world, args=(counting, tokens)) == [True] * world


def _deep_copies_train_alone(tokens: int, after_a_step: bool):
    """A deep copy of a sequence-parallel GPT is a model of its own: its gradients reach its
    own parameters (not the original's), and its reductions keep their own sizes, even when
    the original then runs another sequence length."""
    model, reference, idx, grad = _sequence_parallel_gpt(1, tokens)
    if after_a_step:
        model.forward(idx)
        model.backward(grad)
        model.zero_grad()
    twin = copy.deepcopy(model)
    out = twin.forward(idx)
    model.forward(idx[:, : tokens - 1])  # the original, on another length, in between
    twin.backward(grad)
    np.testing.assert_allclose(out, reference.forward(idx), rtol=1e-10, atol=1e-12)
    reference.backward(grad)
    for (name, p), (_, q), (_, o) in zip(
        twin.named_parameters(),
        reference.named_parameters(),
        model.named_parameters(),
        strict=True,
    ):
        np.testing.assert_allclose(
            full_parameter(p, grad=True), q.grad, rtol=1e-9, atol=1e-12, err_msg=name
        )
        assert o.grad is None, f"{name}: the copy's gradient reached the original"
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, tokens", [(2, 8), (4, 7)])
@pytest.mark.parametrize("after_a_step", [False, True])
def test_a_deep_copy_of_a_split_model_trains_alone(world, tokens, after_a_step):
    args = (tokens, after_a_step)
    assert run_ranks(_deep_copies_train_alone, world, args=args) == [True] * world


def _dropout_masks(sequence_parallel: bool):
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    config = nn.GPTConfig(vocab_size=32, n_layer=1, n_head=4, n_embd=16, block_size=8, dropout=0.5)
    model = nn.GPT(config, dtype=np.float64, rng=0)
    parallelize_module(model, mesh, transformer_plan(model, sequence_parallel=sequence_parallel))
    out = model.forward(np.random.default_rng(1).integers(0, 32, size=(2, 8)))
    block = model.blocks[0]
    masks = {
        "attn": block.attn.attn_dropout.saved("mask"),
        "resid": block.attn.resid_dropout.saved("mask"),
        "mlp": block.mlp[-1].saved("mask"),
    }
    return out, masks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_draws_its_own_masks_where_the_ranks_hold_different_parts(sequence_parallel):
    """Attention dropout drops this rank's heads, so each rank draws its own mask (one seed
    would repeat one pattern over the heads); dropout of replicated activations draws the same
    mask everywhere, so the copies stay equal; of a sequence part, each rank its own."""
    (out0, first), (out1, second) = run_ranks(_dropout_masks, 2, args=(sequence_parallel,))
    assert first["attn"].shape == second["attn"].shape
    assert not np.array_equal(first["attn"], second["attn"])
    for name in ("resid", "mlp"):
        same = first[name].shape == second[name].shape and np.array_equal(first[name], second[name])
        assert same != sequence_parallel, name
    np.testing.assert_array_equal(out0, out1)  # the model's output is replicated either way


def _misapplied_styles():
    from pluribus.parallel import MLPParallel, SequenceParallel, SequenceSharded

    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    errors = []
    norm = nn.LayerNorm(8)
    stack = nn.Sequential(nn.Linear(8, 8, rng=0))
    attention = nn.CausalSelfAttention(8, 2, rng=0)  # two Linears, fused: not an MLP
    for apply in (
        lambda: parallelize_module(norm, mesh, SequenceParallel()),
        lambda: parallelize_module(stack, mesh, SequenceSharded(0)),
        lambda: parallelize_module(attention, mesh, MLPParallel()),
    ):
        for _ in range(2):
            try:
                apply()
            except (ValueError, TypeError) as error:
                errors.append(str(error))
    return errors


@pytest.mark.timeout(60)
def test_styles_applied_twice_or_to_the_wrong_module_are_refused_when_applied():
    for errors in run_ranks(_misapplied_styles, 2):
        assert len(errors) == 4, errors  # each style once, then refused; the MLP both times
        assert "SequenceParallel is already applied" in errors[0]
        assert "SequenceSharded is already applied" in errors[1]
        assert all("MLPParallel needs a Sequential" in e for e in errors[2:])


def _fused_bias_of_other_blocks():
    linear = nn.Linear(4, 6, rng=0)
    linear.weight.blocks = 3  # a fused projection whose bias was not told
    try:
        parallelize_module(linear, init_device_mesh("cpu", (2,)), ColwiseParallel())
    except ValueError as error:
        return str(error), linear.weight.data.shape


@pytest.mark.timeout(60)
def test_a_fused_weight_and_a_bias_of_other_blocks_are_refused_before_splitting():
    for rank, (error, shape) in enumerate(run_ranks(_fused_bias_of_other_blocks, 2)):
        assert error.startswith(f"rank {rank}: Linear(") and "a bias of 1" in error, error
        assert shape == (6, 4)  # nothing split


def _train_vocab_parallel(tp: int, tied: bool, sequence_parallel: bool, steps: int):
    """A GPT whose token embedding and head hold this rank's rows of a 32-token vocabulary
    (11, 11, 10 over 3 ranks), trained with the vocab-parallel loss; one process trains the
    same GPT with nn.CrossEntropyLoss."""
    from pluribus.parallel import VocabParallelCrossEntropyLoss

    config = nn.GPTConfig(
        vocab_size=32, n_layer=1, n_head=6, n_embd=24, block_size=8, tie_weights=tied
    )
    model = nn.GPT(config, dtype=np.float64, rng=0)
    data = np.random.default_rng(7).integers(0, 32, size=(steps, 3, 9))
    data[0, 0, 3] = -100  # an ignored label
    if tp > 1:
        mesh = init_device_mesh("cpu", (tp,))
        plan = transformer_plan(model, sequence_parallel, vocab_parallel=True)
        parallelize_module(model, mesh, plan)
        loss_fn = VocabParallelCrossEntropyLoss(mesh)
    else:
        loss_fn = nn.CrossEntropyLoss()
    opt = nn.AdamW(model.parameters(), lr=1e-2)
    losses, local_vocab = [], None
    for step in range(steps):
        tokens, labels = np.where(data[step] < 0, 0, data[step])[:, :-1], data[step][:, 1:]
        logits = model.forward(tokens)
        local_vocab = logits.shape[-1]
        losses.append(float(loss_fn.forward(logits.reshape(-1, local_vocab), labels.reshape(-1))))
        model.backward(loss_fn.backward().reshape(logits.shape))
        opt.step()
        opt.zero_grad()
    params = {n: full_parameter(p) for n, p in model.named_parameters()}
    return losses, params, local_vocab


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "tp, tied, sequence_parallel",
    [(2, True, False), (3, True, False), (3, False, False), (2, True, True)],
)
def test_vocab_parallel_gpt_trains_as_one_process(tp, tied, sequence_parallel):
    want_losses, want_params, vocab = _train_vocab_parallel(1, tied, False, 3)
    assert vocab == 32
    results = run_ranks(_train_vocab_parallel, tp, args=(tp, tied, sequence_parallel, 3))
    for rank, (losses, params, local_vocab) in enumerate(results):
        assert local_vocab == split_sizes(32, tp)[rank]  # the head gives this rank's rows
        np.testing.assert_allclose(losses, want_losses, rtol=1e-10)
        assert set(params) == set(want_params)  # a tied head is named once
        for name, value in params.items():
            np.testing.assert_allclose(value, want_params[name], rtol=1e-7, atol=1e-9, err_msg=name)


def _vocab_parallel_misuse():
    from pluribus.parallel import VocabParallelCrossEntropyLoss

    mesh = init_device_mesh("cpu", (2,))
    model = nn.GPT(nn.GPTConfig(vocab_size=10, n_layer=1, n_head=2, n_embd=8, block_size=4))
    parallelize_module(model, mesh, transformer_plan(model, vocab_parallel=True))
    errors = []
    for call in (
        lambda: model.generate(np.zeros((1, 2), np.int64), 1),
        lambda: VocabParallelCrossEntropyLoss(mesh).forward(
            np.zeros((2, 3 if pb.get_rank() else 7)), np.zeros(2, np.int64)
        ),
    ):
        try:
            call()
            errors.append(None)
        except (ValueError, KeyError) as error:
            errors.append(str(error))
    return errors


@pytest.mark.timeout(60)
def test_vocab_parallel_logits_are_refused_where_the_whole_vocabulary_is_needed():
    for rank, errors in enumerate(run_ranks(_vocab_parallel_misuse, 2)):
        assert "GPT.generate samples from the logits of all 10 tokens, got 5" in errors[0]
        assert errors[1].startswith(f"rank {rank}: VocabParallelCrossEntropyLoss takes logits")
        assert "[5, 5] classes" in errors[1] and "got [7, 3]" in errors[1]


@st.composite
def _loss_cases(draw):
    rows, classes = draw(st.integers(0, 6)), draw(st.integers(1, 12))
    ignored = draw(st.lists(st.integers(0, max(rows - 1, 0)), max_size=2)) if rows else []
    return rows, classes, draw(st.integers(1, 4)), draw(st.sampled_from([0.0, 0.2])), ignored


def _split_loss(logits, target, eps):
    from pluribus.parallel import VocabParallelCrossEntropyLoss

    p, me = pb.get_world_size(), pb.get_rank()
    sizes = split_sizes(logits.shape[1], p)
    start = sum(sizes[:me])
    loss = VocabParallelCrossEntropyLoss(init_device_mesh("cpu", (p,)), label_smoothing=eps)
    value = float(loss.forward(logits[:, start : start + sizes[me]].copy(), target))
    return value, loss.backward(), start


@settings(max_examples=30, deadline=None)
@given(_loss_cases())
def test_the_vocab_parallel_loss_equals_cross_entropy(case):
    """Any split of the classes, more ranks than classes included, ignored rows and label
    smoothing: the loss on every rank and each rank's part of the gradient equal
    nn.CrossEntropyLoss of the whole logits."""
    rows, classes, world, eps, ignored = case
    rng = np.random.default_rng(rows * 100 + classes)
    logits = rng.normal(size=(rows, classes)) * 3
    target = rng.integers(0, classes, rows)
    target[ignored] = -100
    whole = nn.CrossEntropyLoss(label_smoothing=eps)
    want = float(whole.forward(logits, target))
    want_grad = whole.backward()
    for value, grad, start in run_ranks(_split_loss, world, args=(logits, target, eps)):
        np.testing.assert_allclose(value, want, rtol=1e-12, equal_nan=True)
        np.testing.assert_allclose(grad, want_grad[:, start : start + grad.shape[1]], atol=1e-14)


def _vocab_parallel_refusals():
    """A tied head left out of the plan (refused at its first forward), a refused block before
    the tied table is split, a shared parameter split two ways (the layer stays unsplit and
    takes a right style after), and Partial layouts: each refused on every rank."""
    mesh = init_device_mesh("cpu", (2,))
    config = nn.GPTConfig(vocab_size=10, n_layer=1, n_head=2, n_embd=8, block_size=4)
    errors = []

    def refused(call):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as error:
            errors.append(str(error))

    half = nn.GPT(config, rng=0)
    parallelize_module(half, mesh, {"wte": RowwiseParallel()})  # the tied head left out
    refused(lambda: half.forward(np.zeros((1, 3), np.int64)))
    odd = nn.GPT(nn.GPTConfig(vocab_size=10, n_layer=1, n_head=3, n_embd=9, block_size=4))
    refused(lambda: parallelize_module(odd, mesh, transformer_plan(odd, vocab_parallel=True)))
    untouched = getattr(odd.wte.weight, "tp_layout", None) is None
    shared = nn.Linear(4, 4, rng=0)
    other = nn.Linear(4, 4, rng=1)
    other.weight = shared.weight
    parallelize_module(other, mesh, ColwiseParallel())
    refused(lambda: parallelize_module(shared, mesh, RowwiseParallel()))
    refused(lambda: parallelize_module(shared, mesh, ColwiseParallel()))  # now accepted
    refused(lambda: RowwiseParallel(output_layouts=Partial()))
    refused(lambda: ColwiseParallel(input_layouts=Partial("max")))
    return errors, untouched


@pytest.mark.timeout(60)
def test_vocab_parallel_plans_that_would_split_a_shared_table_wrongly_are_refused():
    for rank, (errors, untouched) in enumerate(run_ranks(_vocab_parallel_refusals, 2)):
        assert errors[0].startswith("Linear(8, 10, bias=False) holds a weight of shape (5, 8)")
        assert errors[1].startswith(f"rank {rank}: 3 heads do not split evenly") and untouched
        assert "split along dimension 0 over" in errors[2] and "along dimension 1" in errors[2]
        assert errors[3] is None
        assert "RowwiseParallel(output_layouts=Partial())" in errors[4]
        assert "ColwiseParallel(input_layouts=Partial('max'))" in errors[5]


def _loss_edge_cases():
    from pluribus.parallel import VocabParallelCrossEntropyLoss

    mesh = init_device_mesh("cpu", (2,))
    me = pb.get_rank()
    rng = np.random.default_rng(3)
    out = {}
    # float16 with label smoothing over 8000 classes: sums past float16's 65504
    logits = (rng.normal(size=(2, 8000)) * 8).astype(np.float16)
    target = np.array([5, 7000])
    loss = VocabParallelCrossEntropyLoss(mesh, label_smoothing=0.1)
    out["half"] = float(loss.forward(logits[:, me * 4000 : (me + 1) * 4000].copy(), target))
    out["half_want"] = float(
        nn.CrossEntropyLoss(label_smoothing=0.1).forward(logits.astype(np.float64), target)
    )
    # one loss over two vocabularies in turn: 10 (5, 5), then 9 (5, 4)
    loss = VocabParallelCrossEntropyLoss(mesh)
    values = []
    for classes in (10, 9):
        whole = rng.normal(size=(3, classes))
        labels = rng.integers(0, classes, 3)
        cut = split_sizes(classes, 2)
        start = sum(cut[:me])
        values.append(float(loss.forward(whole[:, start : start + cut[me]].copy(), labels)))
        values.append(float(nn.CrossEntropyLoss().forward(whole, labels)))
    out["twice"] = values
    # uint8 labels over 300 classes: label 5 on rank 0, 255 on rank 1's side
    whole = rng.normal(size=(2, 300))
    labels = np.array([5, 255], np.uint8)
    out["uint8"] = float(loss.forward(whole[:, me * 150 : (me + 1) * 150].copy(), labels))
    out["uint8_want"] = float(nn.CrossEntropyLoss().forward(whole, labels.astype(np.int64)))
    return out


@pytest.mark.timeout(60)
def test_the_vocab_parallel_loss_in_float16_over_changing_vocabularies_and_narrow_labels():
    for out in run_ranks(_loss_edge_cases, 2):
        assert np.isfinite(out["half"])
        assert out["half"] == pytest.approx(out["half_want"], rel=2e-3)
        got, want = out["twice"][0::2], out["twice"][1::2]
        np.testing.assert_allclose(got, want, rtol=1e-12)
        assert out["uint8"] == pytest.approx(out["uint8_want"], rel=1e-12)


def _lookup_with_inf():
    """A table row that is inf touches only the tokens that look it up."""
    mesh = init_device_mesh("cpu", (2,))
    table = nn.Embedding(10, 4, dtype=np.float64, rng=0)
    table.weight.data[5] = np.inf  # rank 1's first row
    parallelize_module(table, mesh, RowwiseParallel(input_layouts=Replicate()))
    out = table.forward(np.array([[0, 5, 9]]))
    return np.isfinite(out).all(axis=-1).tolist()


def test_a_vocab_parallel_lookup_keeps_a_bad_row_to_its_own_tokens():
    assert run_ranks(_lookup_with_inf, 2) == [[[True, False, True]]] * 2


def _narrow_ids_and_reloaded_fused_weights():
    """Token ids in uint8 over a 600-row table split at row 300; a fused attention whose qkv
    Parameters were replaced (as weight-conversion code does) still splits q, k and v alike;
    an attention refused because its proj is split already is left as it was."""
    mesh = init_device_mesh("cpu", (2,))
    table = nn.Embedding(600, 4, dtype=np.float64, rng=0)
    whole = table.weight.data.copy()
    parallelize_module(table, mesh, RowwiseParallel(input_layouts=Replicate()))
    ids = np.array([[1, 200, 255]], np.uint8)
    looked_up = np.array_equal(table.forward(ids), whole[ids.astype(np.int64)])
    table.backward(np.ones((1, 3, 4)))
    attention = nn.CausalSelfAttention(8, 2, dtype=np.float64, rng=1)
    attention.qkv.weight = nn.Parameter(attention.qkv.weight.data.copy())
    attention.qkv.bias = nn.Parameter(attention.qkv.bias.data.copy())
    reference = copy.deepcopy(attention)
    parallelize_module(attention, mesh, AttentionParallel())
    x = np.random.default_rng(2).normal(size=(1, 3, 8))
    same = np.allclose(attention.forward(x), reference.forward(x), rtol=1e-12, atol=1e-14)
    split_proj = nn.CausalSelfAttention(8, 2, rng=3)
    parallelize_module(split_proj.proj, mesh, RowwiseParallel())
    try:
        parallelize_module(split_proj, mesh, AttentionParallel())
        error = None
    except ValueError as e:
        error = str(e)
    untouched = split_proj.qkv.weight.data.shape == (24, 8) and split_proj.num_heads == 2
    return looked_up, same, error, untouched


@pytest.mark.timeout(60)
def test_narrow_ids_reloaded_fused_weights_and_refusals_that_leave_the_module_whole():
    for rank, (looked_up, same, error, untouched) in enumerate(
        run_ranks(_narrow_ids_and_reloaded_fused_weights, 2)
    ):
        assert looked_up and same
        assert error.startswith(f"rank {rank}: Linear(4, 8") and "already tensor-parallel" in error
        assert untouched


def _fsdp_tp_losses(
    sequence_parallel: bool, vocab_parallel: bool, steps: int, counting: CountingPlugin = None
):
    """Per-rank losses of a GPT split by the plan over tp and fully sharded over dp (2 x 2),
    or alone on a 1-rank world; with ``counting``, the collectives its model and optimizer
    state dicts issued after training instead, and the kinds of their leaves."""
    from pluribus.parallel import VocabParallelCrossEntropyLoss

    config = nn.GPTConfig(vocab_size=32, n_layer=2, n_head=4, n_embd=32, block_size=8)
    model = nn.GPT(config, dtype=np.float64, rng=0)
    data = np.random.default_rng(5).integers(0, 32, size=(steps, 4, 9))
    me, runner, loss_fn, dp = 0, model, nn.CrossEntropyLoss(), 1
    if pb.get_world_size() > 1:
        dp = 2
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = transformer_plan(model, sequence_parallel, vocab_parallel)
        parallelize_module(model, mesh["tp"], plan)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        runner = fully_shard(model, mesh=mesh["dp"])
        me = mesh.get_local_rank("dp")
        if vocab_parallel:
            loss_fn = VocabParallelCrossEntropyLoss(mesh["tp"])
    opt = nn.AdamW(runner.parameters(), lr=1e-2)
    losses, per = [], 4 // dp
    for step in range(steps):
        batch = data[step, per * me : per * (me + 1)]
        logits = runner.forward(batch[:, :-1])
        flat = logits.reshape(-1, logits.shape[-1])
        losses.append(float(loss_fn.forward(flat, batch[:, 1:].reshape(-1))))
        runner.backward(loss_fn.backward().reshape(logits.shape))
        opt.step()
        opt.zero_grad()
    if counting is None:
        return losses
    runner.forward(data[0, :1, :-1])  # the root's parameters gathered, as after a forward
    mark = counting.mark(pb.get_rank())
    model_state = get_model_state_dict(runner)
    optim_state = get_optimizer_state_dict(runner, opt)
    kinds = {type(model_state["blocks.0.attn.qkv.weight"]).__name__}
    kinds |= {type(v).__name__ for v in optim_state["state"]["blocks.1.mlp.2.weight"].values()}
    return counting.since(pb.get_rank(), mark), sorted(kinds)


@pytest.mark.timeout(120)
def test_the_state_dicts_of_fsdp_of_a_split_gpt_do_not_communicate(counting):
    """FSDP's rows of each tensor-parallel piece go into the state dicts as they are (Pieces),
    not gathered over the data-parallel mesh into the whole piece."""
    for issued, kinds in run_ranks(_fsdp_tp_losses, 4, args=(False, False, 2, counting)):
        assert issued == []
        assert kinds == ["Pieces", "int"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "sequence_parallel, vocab_parallel", [(True, False), (False, True), (True, True)]
)
def test_fsdp_of_a_sequence_and_vocab_parallel_gpt_trains_as_one_process(
    sequence_parallel, vocab_parallel
):
    """SequenceParallel's own gradient accumulation and a tied table split by vocabulary,
    both under FSDP over the data-parallel slice: the two halves' mean loss is the whole's."""
    want = run_ranks(_fsdp_tp_losses, 1, args=(False, False, 4))[0]
    results = run_ranks(_fsdp_tp_losses, 4, args=(sequence_parallel, vocab_parallel, 4))
    for tp_rank in range(2):
        mean = (np.array(results[tp_rank]) + np.array(results[2 + tp_rank])) / 2
        np.testing.assert_allclose(mean, want, rtol=1e-12)
