"""torch's PrepareModuleInput, PrepareModuleOutput and SequenceParallel(sequence_dim=...): a
torch-style Llama sequence-parallel plan on the GPT gives the unsplit GPT's outputs and
gradients (uneven sequences included); each move and its gradient's move back, for any pair of
layouts; and every bad argument refused on every rank before anything is hooked or sent."""

from __future__ import annotations

import copy

import numpy as np
import pluribus as pb
import pytest
from dtensor_helpers import CountingPlugin
from hypothesis import given, settings
from hypothesis import strategies as st
from pluribus import nn
from pluribus.dtensor import Partial, Replicate, Shard, init_device_mesh
from pluribus.parallel import (
    AttentionParallel,
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    full_parameter,
    parallelize_module,
)
from pluribus.testing import run_ranks


class Probe(nn.Module):
    """Keeps the inputs its forward got and gives ``result`` (else its first input); its
    backward keeps the gradients it got and gives ``grad_input``."""

    def __init__(self):
        super().__init__()
        self.result = self.grad_input = None

    def forward(self, *args):
        self.seen = args
        return args[0] if self.result is None else self.result

    def backward(self, *grads):
        self.grads_seen = grads
        return self.grad_input


def piece(array, placement, rank: int, world: int):
    """This rank's piece of ``array`` in ``placement`` (array_split sizes)."""
    if isinstance(placement, Shard):
        return np.array_split(array, world, axis=placement.dim)[rank]
    return array


@pytest.fixture
def counting():
    plugin = CountingPlugin()
    manager = pb.get_plugin_manager()
    manager.register(plugin, name="test-tp-prepare-counting")
    yield plugin
    manager.unregister(name="test-tp-prepare-counting")


# -- the headline: torch's Llama sequence-parallel plan, ported to the GPT ----------------------


def _torch_style_plan(model: nn.GPT, mesh) -> None:
    """torch's Llama plan (tok_embeddings, norms, attention and feed-forward, output) in this
    GPT's names. The position table gives the whole sequence; its output is cut to this rank's
    part, to add to the token embedding's reduce-scattered one."""
    parallelize_module(
        model,
        mesh,
        {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "wpe": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    fused = model.config.fused_qkv
    projections = ["attn.qkv"] if fused else ["attn.query", "attn.key", "attn.value"]
    for block in model.blocks:
        block.attn.num_heads //= mesh.size()  # as torch's tutorial does: this rank's heads
        plan = {
            "ln1": SequenceParallel(),
            "attn": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            **{name: ColwiseParallel() for name in projections},
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(),
            "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, mesh, plan)


def _llama_plan_on_the_gpt(tokens: int, tied: bool, fused: bool):
    mesh = init_device_mesh("cpu", (pb.get_world_size(),), mesh_dim_names=("tp",))
    config = nn.GPTConfig(
        vocab_size=30,
        n_layer=2,
        n_head=4,
        n_embd=32,
        block_size=8,
        tie_weights=tied,
        fused_qkv=fused,
    )
    model = nn.GPT(config, dtype=np.float64, rng=0)
    reference = copy.deepcopy(model)
    _torch_style_plan(model, mesh)
    idx = np.random.default_rng(6).integers(0, 30, size=(3, tokens))
    grad = np.random.default_rng(7).normal(size=(3, tokens, 30))
    want = reference.forward(idx)
    reference.backward(grad)
    np.testing.assert_allclose(model.forward(idx), want, rtol=1e-10, atol=1e-12)
    model.backward(grad)
    names = []
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        names.append(name)
        np.testing.assert_array_equal(full_parameter(p), q.data, err_msg=name)
        np.testing.assert_allclose(
            full_parameter(p, grad=True), q.grad, rtol=1e-9, atol=1e-12, err_msg=name
        )
    return names, model.blocks[0].mlp[0].weight.data.shape


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "world, tokens, tied, fused",
    [
        (2, 8, True, True),
        (2, 7, False, False),  # 7 over 2: 4, 3
        (4, 8, False, True),
        (4, 7, True, True),  # 7 over 4: 2, 2, 2, 1
        (4, 5, True, False),
    ],
)
def test_a_torch_style_sequence_parallel_plan_equals_the_gpt(world, tokens, tied, fused):
    """Outputs and every parameter's gradient equal the unsplit GPT's (numpy, one process)."""
    for names, hidden in run_ranks(_llama_plan_on_the_gpt, world, args=(tokens, tied, fused)):
        assert hidden == (128 // world, 32)  # the MLP is split
        assert ("head.weight" in names) != tied  # a tied head is named once


def _deep_copy_of_the_plan(tokens: int):
    """A deep copy of the planned GPT keeps its own sizes: the original runs a shorter
    sequence between the copy's forward and backward, and the copy's gradients still equal
    the unsplit GPT's."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    config = nn.GPTConfig(vocab_size=30, n_layer=1, n_head=4, n_embd=16, block_size=8)
    model = nn.GPT(config, dtype=np.float64, rng=0)
    reference = copy.deepcopy(model)
    _torch_style_plan(model, mesh)
    twin = copy.deepcopy(model)
    idx = np.random.default_rng(1).integers(0, 30, size=(2, tokens))
    grad = np.random.default_rng(2).normal(size=(2, tokens, 30))
    out = twin.forward(idx)
    model.forward(idx[:, : tokens - 2])
    twin.backward(grad)
    np.testing.assert_allclose(out, reference.forward(idx), rtol=1e-10, atol=1e-12)
    reference.backward(grad)
    for (name, p), (_, q), (_, o) in zip(
        twin.named_parameters(), reference.named_parameters(), model.named_parameters(), strict=True
    ):
        np.testing.assert_allclose(
            full_parameter(p, grad=True), q.grad, rtol=1e-9, atol=1e-12, err_msg=name
        )
        assert o.grad is None, f"{name}: the copy's gradient reached the original"
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, tokens", [(2, 7), (4, 7)])
def test_a_deep_copy_of_a_torch_style_plan_keeps_its_own_sizes(world, tokens):
    assert run_ranks(_deep_copy_of_the_plan, world, args=(tokens,)) == [True] * world


def _prepared_around_attention_parallel(tokens: int, input_first: bool):
    """PrepareModuleInput, AttentionParallel() and PrepareModuleOutput on one attention (the
    input move applied before or after the split): forward gathers, splits the heads and cuts
    its part of the sequence, and backward undoes them in reverse (the heads' partial gradients
    summed before the slice, whichever order the input move was applied in)."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rank, world = pb.get_rank(), pb.get_world_size()
    attention = nn.CausalSelfAttention(16, 4, dtype=np.float64, rng=1)
    reference = copy.deepcopy(attention)
    prepare = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    if input_first:
        parallelize_module(attention, mesh, prepare)
    parallelize_module(attention, mesh, AttentionParallel())
    if not input_first:
        parallelize_module(attention, mesh, prepare)
    parallelize_module(
        attention,
        mesh,
        PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
    )
    rng = np.random.default_rng(3)
    x, g = rng.normal(size=(2, tokens, 16)), rng.normal(size=(2, tokens, 16))
    want_y, want_gx = reference.forward(x), reference.backward(g)
    y = attention.forward(piece(x, Shard(1), rank, world))
    np.testing.assert_allclose(y, piece(want_y, Shard(1), rank, world), rtol=1e-10, atol=1e-13)
    gx = attention.backward(piece(g, Shard(1), rank, world))
    np.testing.assert_allclose(gx, piece(want_gx, Shard(1), rank, world), rtol=1e-9, atol=1e-13)
    for (name, p), (_, q) in zip(
        attention.named_parameters(), reference.named_parameters(), strict=True
    ):
        np.testing.assert_allclose(
            full_parameter(p, grad=True), q.grad, rtol=1e-9, atol=1e-13, err_msg=name
        )
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("input_first", [True, False])
@pytest.mark.parametrize("world, tokens", [(2, 5), (4, 6), (2, 4)])
def test_prepare_styles_around_another_style_on_one_module(world, tokens, input_first):
    assert (
        run_ranks(_prepared_around_attention_parallel, world, args=(tokens, input_first))
        == [True] * world
    )


def _input_move_after_colwise(tokens: int):
    """PrepareModuleInput applied after ColwiseParallel on one Linear: its gradient move still
    comes after the split's all-reduce of the partial input gradient."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rank, world = pb.get_rank(), pb.get_world_size()
    linear = nn.Linear(4, 6, dtype=np.float64, rng=0)
    reference = copy.deepcopy(linear)
    parallelize_module(linear, mesh, ColwiseParallel(output_layouts=Replicate()))
    parallelize_module(
        linear, mesh, PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    )
    rng = np.random.default_rng(0)
    x, g = rng.normal(size=(2, tokens, 4)), rng.normal(size=(2, tokens, 6))
    y = linear.forward(piece(x, Shard(1), rank, world))
    np.testing.assert_allclose(y, reference.forward(x), rtol=1e-12)
    gx = linear.backward(g)
    want = piece(reference.backward(g), Shard(1), rank, world)
    np.testing.assert_allclose(gx, want, rtol=1e-10, atol=1e-12)
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tokens", [4, 5])
def test_an_input_move_applied_after_the_split_is_still_outermost(tokens):
    assert run_ranks(_input_move_after_colwise, 2, args=(tokens,)) == [True, True]


# -- the moves, one by one ----------------------------------------------------------------------


def _input_moves(tokens: int):
    """Shard(1) -> Replicate gathers (sizes from the ranks), its gradient is sliced; Replicate
    -> Shard(1) slices, its gradient is gathered in the sizes forward cut."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rank, world = pb.get_rank(), pb.get_world_size()
    rng = np.random.default_rng(tokens)
    x, g = rng.normal(size=(2, tokens, 3)), rng.normal(size=(2, tokens, 3))
    gather, cut = Probe(), Probe()
    parallelize_module(
        gather, mesh, PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    )
    parallelize_module(
        cut,
        mesh,
        PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
    )
    mine = piece(x, Shard(1), rank, world)
    gather.forward(mine)
    np.testing.assert_array_equal(gather.seen[0], x)
    gather.grad_input = g
    back = gather.backward(np.zeros(1))
    np.testing.assert_array_equal(back, piece(g, Shard(1), rank, world))
    cut.forward(x)
    np.testing.assert_array_equal(cut.seen[0], mine)
    cut.grad_input = piece(g, Shard(1), rank, world)
    np.testing.assert_array_equal(cut.backward(np.zeros(1)), g)
    return mine.shape[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, tokens", [(2, 8), (2, 5), (3, 7), (4, 3)])
def test_prepare_module_input_gathers_and_cuts_and_moves_the_gradient_back(world, tokens):
    sizes = run_ranks(_input_moves, world, args=(tokens,))
    assert sizes == [len(s) for s in np.array_split(np.arange(tokens), world)]


def _several_inputs(first_only: bool):
    """Four positional inputs: gathered, left alone (not an array), cut, and sharded by their
    last dimension moved to the first (all-to-all); backward gives one gradient per input, or
    the first input's only."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rank, world = pb.get_rank(), pb.get_world_size()
    rng = np.random.default_rng(11)
    a, c, d = rng.normal(size=(2, 5, 3)), rng.normal(size=(5, 4)), rng.normal(size=(3, 7))
    ga, gc, gd = rng.normal(size=a.shape), rng.normal(size=c.shape), rng.normal(size=d.shape)
    src = (Shard(1), None, Replicate(), Shard(-1))
    dst = (Replicate(), None, Shard(0), Shard(0))
    probe = Probe()
    parallelize_module(
        probe, mesh, PrepareModuleInput(input_layouts=src, desired_input_layouts=dst)
    )
    mask = "causal"
    values = (a, mask, c, d)
    probe.forward(*(piece(v, p, rank, world) if p else v for v, p in zip(values, src, strict=True)))
    seen = probe.seen
    np.testing.assert_array_equal(seen[0], a)
    assert seen[1] is mask
    np.testing.assert_array_equal(seen[2], piece(c, Shard(0), rank, world))
    np.testing.assert_array_equal(seen[3], piece(d, Shard(0), rank, world))
    grads = (ga, None, piece(gc, Shard(0), rank, world), piece(gd, Shard(0), rank, world))
    probe.grad_input = grads[0] if first_only else grads
    back = probe.backward(np.zeros(1))
    if first_only:
        np.testing.assert_array_equal(back, piece(ga, Shard(1), rank, world))
        return True
    np.testing.assert_array_equal(back[0], piece(ga, Shard(1), rank, world))
    assert back[1] is None
    np.testing.assert_array_equal(back[2], gc)
    np.testing.assert_array_equal(back[3], piece(gd, Shard(1), rank, world))
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("first_only", [False, True])
def test_prepare_module_input_with_several_inputs_and_none_entries(world, first_only):
    assert run_ranks(_several_inputs, world, args=(first_only,)) == [True] * world


class KeywordProbe(Probe):
    """A Probe whose forward also takes keyword inputs, kept in ``seen_kwargs``."""

    def forward(self, *args, **kwargs):
        self.seen_kwargs = kwargs
        return super().forward(*args)


def _keyword_inputs(with_positional: bool):
    """torch's input_kwarg_layouts: a keyword table gathered (its sizes from the ranks) and a
    keyword mask cut, forward only; a name not passed is skipped; the positional input moves
    as before, or is left alone when only keyword layouts are given."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rank, world = pb.get_rank(), pb.get_world_size()
    rng = np.random.default_rng(3)
    x, table, mask = rng.normal(size=(2, 5, 3)), rng.normal(size=(5, 4)), rng.normal(size=(6, 2))
    positional = {}
    if with_positional:
        positional = {"input_layouts": Shard(1), "desired_input_layouts": Replicate()}
    probe = KeywordProbe()
    parallelize_module(
        probe,
        mesh,
        PrepareModuleInput(
            **positional,
            input_kwarg_layouts={
                "table": Shard(0), "mask": Replicate(), "absent": Shard(0), "bias": None
            },
            desired_input_kwarg_layouts={
                "table": Replicate(), "mask": Shard(0), "absent": Replicate(), "bias": None
            },
        ),
    )  # fmt: skip
    given = piece(x, Shard(1), rank, world) if with_positional else x
    bias = np.full(rank + 1, 7.0)  # None in both: left as it is, whatever its shape
    probe.forward(given, table=piece(table, Shard(0), rank, world), mask=mask, scale=2.0, bias=bias)
    assert probe.seen_kwargs["bias"] is bias
    # keyword layouts of None only: every input left as it is, the positional ones too
    idle = KeywordProbe()
    parallelize_module(
        idle,
        mesh,
        PrepareModuleInput(
            input_kwarg_layouts={"bias": None}, desired_input_kwarg_layouts={"bias": None}
        ),
    )
    idle.forward(x[rank:], bias=bias)
    np.testing.assert_array_equal(idle.seen[0], x[rank:])
    assert idle.seen_kwargs["bias"] is bias
    np.testing.assert_array_equal(probe.seen[0], x)
    np.testing.assert_array_equal(probe.seen_kwargs["table"], table)
    np.testing.assert_array_equal(probe.seen_kwargs["mask"], piece(mask, Shard(0), rank, world))
    assert probe.seen_kwargs["scale"] == 2.0 and "absent" not in probe.seen_kwargs
    g = rng.normal(size=x.shape)
    probe.grad_input = g
    back = probe.backward(np.zeros(1))
    want = piece(g, Shard(1), rank, world) if with_positional else g
    np.testing.assert_array_equal(back, want)
    # a keyword value the layouts do not fit is refused at forward, naming it
    try:
        probe.forward(given, table=np.zeros(()), mask=mask)
    except ValueError as error:
        return str(error)
    return None


class KeywordFirst(Probe):
    """A module whose first input (the one its backward gives the gradient of) has a name."""

    def forward(self, x, *, mask=None):
        return super().forward(x)


def _keyword_refusals():
    """A keyword value refused (its sizes are not the array_split ones) before the positional
    input moves; the first input named as a keyword layout refused when the style is applied
    (keyword inputs move forward only); a keyword that is no array refused with advice that
    can be followed."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rank, world = pb.get_rank(), pb.get_world_size()
    errors = []
    probe = KeywordProbe()
    parallelize_module(
        probe,
        mesh,
        PrepareModuleInput(
            input_layouts=Shard(0),
            desired_input_layouts=Replicate(),
            input_kwarg_layouts={"table": Shard(0)},
            desired_input_kwarg_layouts={"table": Replicate()},
        ),
    )
    x = np.array_split(np.arange(4.0), world)[rank]
    uneven = np.ones((1 if rank == 0 else 2, 2))  # sizes (1, 2, ...): not array_split's
    for call in (
        lambda: probe.forward(x, table=uneven),
        lambda: probe.forward(x, table=None),
        lambda: parallelize_module(
            KeywordFirst(),
            mesh,
            PrepareModuleInput(
                input_kwarg_layouts={"x": Shard(0)}, desired_input_kwarg_layouts={"x": Replicate()}
            ),
        ),
        lambda: PrepareModuleInput(
            input_kwarg_layouts={"mask": None}, desired_input_kwarg_layouts={"mask": Replicate()}
        ),
    ):
        try:
            call()
            errors.append(None)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    return errors, "_tp_input_shapes" in probe.__dict__


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_keyword_inputs_are_refused_before_anything_moves(world):
    for rank, (errors, moved) in enumerate(run_ranks(_keyword_refusals, world)):
        assert all(e is not None and e.startswith(f"rank {rank}") for e in errors), errors
        assert "rows for the ranks of the mesh" in errors[0]
        assert not moved  # the positional input was not gathered before the refusal
        assert "keyword input table" in errors[1] and "leave the keyword out" in errors[1]
        assert "'x' is its forward's first input" in errors[2]
        assert "pass it positionally" in errors[2]
        assert "input_kwarg_layouts['mask']=None): give a Placement" in errors[3]
        assert "or None in both dicts for a keyword left as it is" in errors[3]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("with_positional", [True, False])
def test_prepare_module_input_moves_keyword_inputs(world, with_positional):
    for rank, error in enumerate(run_ranks(_keyword_inputs, world, args=(with_positional,))):
        assert error is not None and error.startswith(f"rank {rank}")
        assert "keyword input table of KeywordProbe()" in error
        assert "has shape (), which has no dimension 0 for Shard(0)" in error


def _output_moves():
    """One output cut (Replicate -> Shard(0)), its gradient gathered; a tuple of outputs with
    one left alone and one gathered (Shard(1) -> Replicate), their gradients cut."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rank, world = pb.get_rank(), pb.get_world_size()
    rng = np.random.default_rng(5)
    y, g = rng.normal(size=(7, 4)), rng.normal(size=(7, 4))
    table = Probe()
    parallelize_module(
        table,
        mesh,
        PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
    )
    np.testing.assert_array_equal(table.forward(y), piece(y, Shard(0), rank, world))
    table.backward(piece(g, Shard(0), rank, world))
    assert len(table.grads_seen) == 1
    np.testing.assert_array_equal(table.grads_seen[0], g)
    pair = Probe()
    parallelize_module(
        pair,
        mesh,
        PrepareModuleOutput(
            output_layouts=(None, Shard(1)), desired_output_layouts=(None, Replicate())
        ),
    )
    z, gz = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 5, 3))
    pair.result = ("kept", piece(z, Shard(1), rank, world))
    out = pair.forward(np.zeros(1))
    assert isinstance(out, tuple) and out[0] == "kept"
    np.testing.assert_array_equal(out[1], z)
    pair.backward(None, gz)
    assert pair.grads_seen[0] is None
    np.testing.assert_array_equal(pair.grads_seen[1], piece(gz, Shard(1), rank, world))
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_prepare_module_output_moves_outputs_and_their_gradients(world):
    assert run_ranks(_output_moves, world) == [True] * world


_LAYOUTS = st.sampled_from([Replicate(), Shard(0), Shard(1), Shard(-1)])


def _round_trip(kind: str, shape, src, dst, seed: int):
    """Forward: ``src``'s piece in, ``dst``'s piece seen (input) or given (output); backward:
    ``dst``'s piece of the gradient in, ``src``'s piece out."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rank, world = pb.get_rank(), pb.get_world_size()
    rng = np.random.default_rng(seed)
    x, g = rng.normal(size=shape), rng.normal(size=shape)
    probe = Probe()
    if kind == "input":
        style = PrepareModuleInput(input_layouts=src, desired_input_layouts=dst)
        parallelize_module(probe, mesh, style)
        probe.forward(piece(x, src, rank, world))
        got = probe.seen[0]
        probe.grad_input = piece(g, dst, rank, world)
        back = probe.backward(np.zeros(1))
    else:
        style = PrepareModuleOutput(output_layouts=src, desired_output_layouts=dst)
        parallelize_module(probe, mesh, style)
        got = probe.forward(piece(x, src, rank, world))
        probe.backward(piece(g, dst, rank, world))
        back = probe.grads_seen[0]
    np.testing.assert_array_equal(got, piece(x, dst, rank, world))
    np.testing.assert_array_equal(back, piece(g, src, rank, world))
    return True


@pytest.mark.timeout(300)
@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["input", "output"]),
    st.lists(st.integers(0, 6), min_size=2, max_size=3),
    _LAYOUTS,
    _LAYOUTS,
    st.integers(1, 4),
    st.integers(0, 100),
)
def test_any_pair_of_layouts_moves_forward_and_its_gradient_back(
    kind, shape, src, dst, world, seed
):
    """Any sizes (empty pieces, more ranks than rows), any two of Replicate and Shard(d): the
    forward value is the desired layout's piece of the whole, the gradient the given one's."""
    results = run_ranks(_round_trip, world, args=(kind, tuple(shape), src, dst, seed))
    assert results == [True] * world


def _sequence_parallel_dropout():
    """SequenceParallel on a seeded dropout: each rank drops its own tokens' elements by a
    stream of its own."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    drop = nn.Dropout(0.5, seed=3)
    parallelize_module(drop, mesh, SequenceParallel(sequence_dim=1))
    drop.forward(np.ones((2, 4, 8)))
    return drop.saved("mask")


@pytest.mark.timeout(60)
def test_sequence_parallel_gives_a_dropout_its_own_stream():
    first, second = run_ranks(_sequence_parallel_dropout, 2)
    assert not np.array_equal(first, second)


# -- refusals -----------------------------------------------------------------------------------


def _refusals(counting: CountingPlugin):
    """Each bad argument raises on this rank, naming it, before anything is hooked or sent."""
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rank = pb.get_rank()
    errors: list[tuple[str, str]] = []
    mark = counting.mark(rank)

    def refused(call) -> None:
        try:
            call()
        except (ValueError, TypeError, RuntimeError) as error:
            errors.append((type(error).__name__, str(error)))
        else:
            errors.append(("none", ""))

    PMI, PMO = PrepareModuleInput, PrepareModuleOutput
    refused(lambda: PMI(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(),)))
    refused(lambda: PMI(input_layouts=Partial(), desired_input_layouts=Replicate()))
    refused(
        lambda: PMI(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), Shard(0)))
    )
    refused(
        lambda: PMI(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=False
        )
    )
    refused(
        lambda: PMI(
            input_kwarg_layouts={"x": Shard(1)}, desired_input_kwarg_layouts={"y": Replicate()}
        )
    )
    refused(lambda: PMI(input_layouts="shard", desired_input_layouts=Replicate()))
    refused(lambda: PMI())
    refused(lambda: PMO(output_layouts=(Shard(0),), desired_output_layouts=(Replicate(), None)))
    refused(lambda: PMO(output_layouts=Replicate(), desired_output_layouts=Partial("max")))
    refused(lambda: PMO(output_layouts=None, desired_output_layouts=Replicate()))
    refused(
        lambda: PMO(
            output_layouts=Shard(0), desired_output_layouts=Replicate(), use_local_output=False
        )
    )
    refused(lambda: SequenceParallel(sequence_dim="1"))
    refused(lambda: SequenceParallel(sequence_dim=True))
    refused(lambda: SequenceParallel(use_local_output=False))
    constructed = len(errors)
    # applied twice, or to what is not a module, or a plan entry that is not a style
    probe = Probe()
    gather = PMI(input_layouts=Shard(1), desired_input_layouts=Replicate())
    parallelize_module(probe, mesh, gather)
    hooks = (len(probe._forward_pre_hooks), len(probe._backward_hooks))
    refused(lambda: parallelize_module(probe, mesh, gather))
    assert (len(probe._forward_pre_hooks), len(probe._backward_hooks)) == hooks
    refused(lambda: gather.apply(object(), mesh))
    refused(lambda: parallelize_module(Probe(), mesh, {"*": "colwise"}))
    # inputs that the layouts do not fit, refused at forward
    refused(lambda: probe.forward(np.zeros((2, 3, 4)), np.zeros(3)))  # two inputs, one layout
    refused(lambda: probe.forward(np.zeros(3)))  # no dimension 1
    refused(lambda: probe.forward([[1.0, 2.0]]))  # not an array
    sliced = Probe()
    parallelize_module(
        sliced, mesh, PMO(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    )
    refused(lambda: sliced.backward(np.zeros(2)))  # a gradient before any forward
    norm = nn.LayerNorm(4)
    parallelize_module(norm, mesh, SequenceParallel(sequence_dim=2))
    refused(lambda: norm.forward(np.zeros((3, 4))))
    sent = counting.since(rank, mark)
    return errors, constructed, sent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_bad_arguments_are_refused_on_every_rank_before_anything_is_hooked_or_sent(world, counting):
    expected = [
        ("ValueError", "one layout and one desired layout per positional input"),
        ("ValueError", "PrepareModuleInput(input_layouts[0]=Partial())"),
        ("ValueError", "None leaves that input as it is, so it goes in both or neither"),
        ("ValueError", "use_local_output=True is the only choice"),
        ("ValueError", "give two dicts with the same keyword names"),
        ("TypeError", "give a Placement"),
        ("TypeError", "PrepareModuleInput(input_layouts=None)"),
        ("ValueError", "one layout and one desired layout per positional output"),
        ("ValueError", "desired_output_layouts[0]=Partial('max')"),
        ("TypeError", "PrepareModuleOutput(output_layouts=None)"),
        ("ValueError", "PrepareModuleOutput(use_local_output=False)"),
        ("TypeError", "SequenceParallel(sequence_dim='1')"),
        ("TypeError", "SequenceParallel(sequence_dim=True)"),
        ("ValueError", "SequenceParallel(use_local_output=False)"),
        ("ValueError", "PrepareModuleInput is already applied"),
        ("TypeError", "hooks a pluribus.nn Module, got object"),
        ("TypeError", "parallelize_plan is a style or a dict"),
        ("ValueError", "has 2 positional input(s) but its Prepare layouts name 1"),
        ("ValueError", "which has no dimension 1 for Shard(1)"),
        ("TypeError", "is a list, not an array"),
        ("RuntimeError", "got a gradient before any forward"),
        ("ValueError", "SequenceParallel(sequence_dim=2)"),
    ]
    for rank, (errors, constructed, sent) in enumerate(
        run_ranks(_refusals, world, args=(counting,))
    ):
        assert constructed == 14
        assert len(errors) == len(expected), errors
        for (kind, message), (want_kind, want) in zip(errors, expected, strict=True):
            assert kind == want_kind and want in message, (message, want)
            assert message.startswith(f"rank {rank}: "), message
        assert sent == [], sent  # nothing sent: every refusal came before a collective


def _input_and_output_moves():
    """PrepareModuleInputOutput: the sequence gathered in and cut out again, the output's
    gradient gathered before backward and the input's cut after it; and its refusals."""
    from pluribus.parallel import PrepareModuleInputOutput

    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rank, world = pb.get_rank(), pb.get_world_size()
    rng = np.random.default_rng(7)
    x, g = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 5, 3))
    probe = Probe()
    style = PrepareModuleInputOutput(
        input_layouts=Shard(1),
        desired_input_layouts=Replicate(),
        output_layouts=Replicate(),
        desired_output_layouts=Shard(1),
    )
    parallelize_module(probe, mesh, style)
    out = probe.forward(piece(x, Shard(1), rank, world))
    np.testing.assert_array_equal(probe.seen[0], x)
    np.testing.assert_array_equal(out, piece(x, Shard(1), rank, world))
    probe.grad_input = 2 * g
    back = probe.backward(piece(g, Shard(1), rank, world))
    np.testing.assert_array_equal(probe.grads_seen[0], g)
    np.testing.assert_array_equal(back, piece(2 * g, Shard(1), rank, world))
    output_moved = parallelize_module(
        Probe(),
        mesh,
        PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
    )
    errors = []
    for make in (
        lambda: PrepareModuleInputOutput(
            use_local_input=False, output_layouts=Replicate(), desired_output_layouts=Shard(1)
        ),
        lambda: parallelize_module(probe, mesh, style),  # applied again
        lambda: parallelize_module(output_moved, mesh, style),  # its output style applied
    ):
        try:
            make()
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_prepare_module_input_output_moves_both_ways_and_refuses_bad_use(world):
    for rank, errors in enumerate(run_ranks(_input_and_output_moves, world)):
        assert len(errors) == 3, errors
        assert all(e.startswith(f"rank {rank}") for e in errors), errors
        assert "use_local_input=True is the only choice" in errors[0]
        assert "already applied" in errors[1] and "already applied" in errors[2]
