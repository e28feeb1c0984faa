"""One state dict for a model however it is spread (``pluribus.parallel.get_model_state_dict``
and friends) through pluribus.checkpoint: a GPT with fused q, k, v trained two steps on a
2 x 2 (dp x tp) mesh under DDP or FSDP, or in one process, saved, loaded split over 4 ranks, on
2 x 2 under DDP or FSDP, under DDP alone, in one process or fully sharded, and trained two
more steps, equals four steps in one process (the fused projection's blocks regrouped on load
where the forms differ)."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus import checkpoint, nn
from pluribus.dtensor import DTensor, Shard, init_device_mesh
from pluribus.parallel import (
    DistributedDataParallel,
    full_parameter,
    fully_shard,
    get_model_state_dict,
    get_optimizer_state_dict,
    parallelize_module,
    set_model_state_dict,
    set_optimizer_state_dict,
    transformer_plan,
)
from pluribus.parallel.state_dict import _to_state
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(180)

VOCAB, ROWS = 32, 4


def _model():
    config = nn.GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, block_size=8)
    return nn.GPT(config, dtype=np.float64, rng=0)


def _spread(model, how: str, dp: int, tp: int):
    """(the module to train, the data-parallel index of this rank) for ``how``."""
    if how == "fsdp":  # every rank the whole batch: the average of equal gradients
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model), 0
    if how == "fsdp-tp":  # 2-D: split over tp, the pieces sharded over dp
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], transformer_plan(model))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"]), mesh["dp"].get_local_rank()
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], transformer_plan(model))
        return DistributedDataParallel(model, process_group=mesh.get_group("dp")), mesh[
            "dp"
        ].get_local_rank()
    if dp > 1:
        return DistributedDataParallel(model), pb.get_rank()
    return model, 0


def _whole_parameters(model) -> dict:
    if isinstance(model, DistributedDataParallel):
        model = model.module
    if any(getattr(p, "tp_layout", None) is not None for p in model.parameters()) and hasattr(
        model, "fsdp_units"
    ):  # FSDP of a split model: each unit's pieces gathered, then the split undone
        shapes = {n: p.data.shape for n, p in _model().named_parameters()}
        names, whole = {id(p): n for n, p in model.named_parameters()}, {}
        for unit in model.fsdp_units():
            fulls = unit.gather_full(unit.shard_views, unit.dtype)
            for piece, full in zip(unit.pieces, fulls, strict=True):
                value, name = _to_state(piece.param, full), names[id(piece.param)]
                value = value.full_tensor() if isinstance(value, DTensor) else value
                whole[name] = np.asarray(value).reshape(shapes[name])
        return whole
    if hasattr(model, "full_state_dict"):  # FSDP: whole arrays on rank 0, broadcast
        return pb.broadcast_object({k: np.asarray(v) for k, v in model.full_state_dict().items()})
    return {name: full_parameter(p) for name, p in model.named_parameters()}


def _steps(runner, opt, steps: range, dp: int, me: int) -> None:
    """Train ``steps`` of the fixed batches, this data-parallel rank ``me`` its rows."""
    data = np.random.default_rng(5).integers(0, VOCAB, size=(4, ROWS, 9))
    loss_fn, per = nn.CrossEntropyLoss(), ROWS // dp
    for step in steps:
        batch = data[step, per * me : per * (me + 1)]
        logits = runner.forward(batch[:, :-1])
        loss_fn.forward(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        runner.backward(loss_fn.backward().reshape(logits.shape))
        opt.step()
        opt.zero_grad()


def _train(how: str, dp: int, tp: int, steps: range, path: str | None, load: str | None):
    model = _model()
    runner, me = _spread(model, how, dp, tp)
    opt = nn.AdamW(runner.parameters() if how.startswith("fsdp") else model.parameters(), lr=1e-2)
    if load is not None:
        state = {
            "model": get_model_state_dict(runner),
            "optim": get_optimizer_state_dict(runner, opt),
        }
        checkpoint.load(state, load)
        set_model_state_dict(runner, state["model"])
        set_optimizer_state_dict(runner, opt, state["optim"])
    _steps(runner, opt, steps, dp, me)
    saved = None
    if path is not None:
        state = {
            "model": get_model_state_dict(runner),
            "optim": get_optimizer_state_dict(runner, opt),
        }
        qkv = state["model"]["blocks.0.attn.qkv.weight"]
        saved = (type(qkv).__name__, tuple(qkv.shape), getattr(qkv, "placements", None))
        if type(qkv).__name__ == "Pieces":  # the boxes, and the optimizer state's alike
            boxes = [(o, a.shape) for o, a in qkv.pieces]
            moments = state["optim"]["state"]["blocks.0.attn.qkv.weight"]["exp_avg"]
            saved = (*saved[:2], boxes, [(o, a.shape) for o, a in moments.pieces] == boxes)
        checkpoint.save(state, path)
    return _whole_parameters(runner), saved


SAVERS = {
    "saved-dp2-tp2": ("tp", 2, 2),
    "saved-alone": ("none", 1, 1),
    "saved-fsdp2-tp2": ("fsdp-tp", 2, 2),
}


@pytest.fixture(scope="module", params=sorted(SAVERS))
def two_steps(request, tmp_path_factory):
    """A checkpoint of two steps, written split over a 2 x 2 mesh or by one process."""
    how, dp, tp = SAVERS[request.param]
    path = str(tmp_path_factory.mktemp("ckpt") / request.param)
    results = run_ranks(_train, dp * tp, args=(how, dp, tp, range(2), path, None))
    return request.param, path, results


def _fsdp_rows_of_the_qkv_piece(rank: int) -> list:
    """FSDP's half (24 rows) of this rank's (48, 32) piece of the (96, 32) projection: 16 rows
    of one block and 8 of the next, in the (3, 32, 32) form, at this tp rank's columns."""
    dp, tp = divmod(rank, 2)
    first, second = ((0, 0), (1, 0)) if dp == 0 else ((1, 8), (2, 0))
    sizes = ((1, 16, 32), (1, 8, 32)) if dp == 0 else ((1, 8, 32), (1, 16, 32))
    return [((b, row + 16 * tp, 0), s) for (b, row), s in zip((first, second), sizes, strict=True)]


def test_a_split_parameter_is_saved_with_its_blocks_first(two_steps):
    """Split: a DTensor of the blocked shape, this rank's rows of each block; under FSDP too,
    FSDP's rows of that piece as boxes of the blocked shape, nothing gathered."""
    saver, _, results = two_steps
    for rank, (_, saved) in enumerate(results):
        if saver == "saved-fsdp2-tp2":
            assert saved == ("Pieces", (3, 32, 32), _fsdp_rows_of_the_qkv_piece(rank), True)
        elif saver != "saved-alone":
            assert saved == ("DTensor", (3, 32, 32), (Shard(1),))
        else:
            assert saved == ("ndarray", (96, 32), None)


@pytest.mark.parametrize(
    "how, dp, tp",
    [
        ("tp", 1, 4),
        ("tp", 1, 2),
        ("tp", 2, 2),
        ("ddp", 2, 1),
        ("none", 1, 1),
        ("fsdp", 3, 1),
        ("fsdp-tp", 2, 2),
    ],
    ids=["tp4", "tp2", "dp2-tp2", "ddp2", "one-process", "fsdp3", "fsdp2-tp2"],
)
def test_resumed_in_another_layout_equals_one_process(two_steps, how, dp, tp):
    _, path, _ = two_steps
    want = _train_alone(range(4))
    world = dp * tp
    if how == "fsdp":  # 4 rows do not split over 3 ranks: each takes them all
        dp = 1
    for params, _ in run_ranks(_train, world, args=(how, dp, tp, range(2, 4), None, path)):
        assert set(params) == set(want)
        for name, value in params.items():
            np.testing.assert_allclose(value, want[name], rtol=1e-7, atol=1e-9, err_msg=name)


def test_every_layout_saves_the_same_parameters_and_optimizer_state(two_steps, tmp_path):
    """Read back whole, a checkpoint of the 2-D or the tp model's pieces holds what one
    process saves, the optimizer's moments included."""
    _, path, _ = two_steps
    alone = str(tmp_path / "alone")
    run_ranks(_train, 1, args=("none", 1, 1, range(2), alone, None))
    got, want = checkpoint.read_whole(path), checkpoint.read_whole(alone)
    assert set(got) == set(want) and any(k.endswith("exp_avg_sq") for k in got)
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_allclose(
                got[key].reshape(value.shape), value, rtol=1e-7, atol=1e-9, err_msg=key
            )


def _train_alone(steps: range) -> dict:
    return run_ranks(_train, 1, args=("none", 1, 1, steps, None, None))[0][0]


def _whole_arrays_into_a_split_model():
    """A plain model's state_dict (qkv as (96, 32)) and the blocked form ((3, 32, 32)) both load
    into a split model; a wrong shape is refused on every rank, naming both shapes."""
    plain = _model()
    for p in plain.parameters():
        p.data += 1.0
    model = _model()
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    parallelize_module(model, mesh, transformer_plan(model))
    set_model_state_dict(model, plain.state_dict())
    first = {n: full_parameter(p) for n, p in model.named_parameters()}
    blocked = {k: v.copy() for k, v in plain.state_dict().items()}
    blocked["blocks.0.attn.qkv.weight"] = blocked["blocks.0.attn.qkv.weight"].reshape(3, 32, 32)
    set_model_state_dict(model, blocked)
    second = {n: full_parameter(p) for n, p in model.named_parameters()}
    blocked["blocks.0.attn.qkv.weight"] = np.zeros((32, 96))
    try:
        set_model_state_dict(model, blocked)
        error = None
    except ValueError as e:
        error = str(e)
    want = dict(plain.state_dict())
    return (
        all(np.array_equal(first[k], want[k]) for k in first),
        all(np.array_equal(second[k], want[k]) for k in second),
        error,
    )


def test_whole_arrays_load_into_a_split_model_and_wrong_shapes_are_refused():
    for rank, (first, second, error) in enumerate(run_ranks(_whole_arrays_into_a_split_model, 2)):
        assert first and second
        assert error == (
            f"rank {rank}: 'blocks.0.attn.qkv.weight' has shape (32, 96) in the state but "
            "(96, 32) in the model (or (3, 32, 32), its 3 blocks first)"
        )


def _fresh_optimizer_state():
    """An optimizer that has not stepped gets the zero state of a first step, and a step from it
    equals a first step."""
    model, twin = _model(), _model()
    opt, twin_opt = nn.AdamW(model.parameters(), lr=1e-2), nn.AdamW(twin.parameters(), lr=1e-2)
    state = get_optimizer_state_dict(model, opt)
    entry = state["state"]["blocks.0.attn.qkv.weight"]
    shapes = (tuple(entry["exp_avg"].shape), entry["step"])
    x = np.random.default_rng(1).integers(0, VOCAB, size=(2, 8))
    for m, o in ((model, opt), (twin, twin_opt)):
        m.backward(np.ones_like(m.forward(x)))
        o.step()
    same = all(
        np.array_equal(a.data, b.data)
        for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )
    return shapes, same, isinstance(entry["exp_avg"], DTensor)


def test_an_optimizer_that_has_not_stepped_gets_a_first_steps_zero_state():
    shapes, same, is_dtensor = run_ranks(_fresh_optimizer_state, 1)[0]
    assert shapes == ((96, 32), 0)
    assert same and not is_dtensor


def _fsdp_after_a_forward(path: str):
    """A fresh optimizer's state dict taken after a forward (the root's parameters gathered)
    holds shard-sized zero state, saves, and the next step works."""
    model = nn.Sequential(nn.Linear(4, 6, rng=1), nn.ReLU(), nn.Linear(6, 2, rng=2))
    fully_shard(model)
    opt = nn.AdamW(model.parameters(), lr=1e-2)
    model.forward(np.ones((3, 4), np.float32))
    state = get_optimizer_state_dict(model, opt)
    checkpoint.save({"optim": state}, path)
    shapes = {n: tuple(e["exp_avg"].shape) for n, e in state["state"].items()}
    pieces = {n: tuple(e["exp_avg"].to_local().shape) for n, e in state["state"].items()}
    y = model.forward(np.ones((3, 4), np.float32))
    model.backward(np.ones_like(y))
    opt.step()
    return shapes, pieces


def test_fsdp_optimizer_state_after_a_forward_is_sharded(tmp_path):
    results = run_ranks(_fsdp_after_a_forward, 2, args=(str(tmp_path / "c"),))
    for rank, (shapes, pieces) in enumerate(results):
        assert shapes == {"0.weight": (6, 4), "0.bias": (6,), "2.weight": (2, 6), "2.bias": (2,)}
        assert pieces["0.weight"] == (3, 4) and pieces["2.weight"] == (1, 6), rank


def _fsdp_takes_blocked_whole_arrays():
    """The blocked form of a fused projection, as a whole array and as a DTensor of a split
    model's layout, loads into an FSDP model (which holds the merged shape)."""
    plain = _model()
    for p in plain.parameters():
        p.data += 1.0
    blocked = {k: v.copy() for k, v in plain.state_dict().items()}
    blocked["blocks.0.attn.qkv.weight"] = blocked["blocks.0.attn.qkv.weight"].reshape(3, 32, 32)
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    set_model_state_dict(model, blocked)
    got = {k: np.asarray(v) for k, v in model.full_state_dict().items()}
    split = _model()
    parallelize_module(
        split, init_device_mesh("cpu", (pb.get_world_size(),)), transformer_plan(split)
    )
    set_model_state_dict(split, plain.state_dict())
    set_model_state_dict(model, {k: v * 0 for k, v in plain.state_dict().items()})
    set_model_state_dict(model, get_model_state_dict(split))  # DTensors, the split layout
    again = {k: np.asarray(v) for k, v in model.full_state_dict().items()}
    want = plain.state_dict()
    if pb.get_rank():
        return True
    return all(np.array_equal(got[k], want[k]) and np.array_equal(again[k], want[k]) for k in want)


def test_an_fsdp_model_takes_the_blocked_form():
    assert run_ranks(_fsdp_takes_blocked_whole_arrays, 2) == [True, True]


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(np.array(2.0, np.float32))


def test_a_scalar_parameters_optimizer_state_keeps_its_dtype():
    model = _Scaled()
    opt = nn.AdamW(model.parameters(), lr=0.1)
    model.scale.grad = np.array(0.5, np.float32)
    opt.step()
    state = get_optimizer_state_dict(model, opt)
    assert isinstance(state["state"]["scale"]["exp_avg"], float)
    fresh = nn.AdamW(model.parameters(), lr=0.1)
    set_optimizer_state_dict(model, fresh, state)
    loaded = fresh.state[0]
    assert loaded["exp_avg"].dtype == np.float32 and loaded["step"].dtype == np.int64
    assert float(loaded["exp_avg"]) == pytest.approx(0.05)


def _vocab_parallel_saved(path: str):
    """A GPT whose tied embedding and head are split by vocabulary rows saves the table as a
    Shard(0) DTensor named once; one process loads it whole."""
    model = _model()
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    parallelize_module(model, mesh, transformer_plan(model, vocab_parallel=True))
    state = get_model_state_dict(model)
    checkpoint.save(state, path)
    wte = state["wte.weight"]
    return (tuple(wte.shape), wte.placements, "head.weight" in state), {
        n: full_parameter(p) for n, p in model.named_parameters()
    }


def test_a_vocab_parallel_gpt_saves_its_rows_and_loads_whole(tmp_path):
    path = str(tmp_path / "v")
    (saved, want), *_ = run_ranks(_vocab_parallel_saved, 4, args=(path,))
    assert saved == ((32, 32), (Shard(0),), False)  # tied: one table
    model = _model()
    for p in model.parameters():
        p.data[...] = 0
    state = get_model_state_dict(model)
    checkpoint.load(state, path)
    set_model_state_dict(model, state)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.data, want[name], err_msg=name)


def _pieces_refused():
    """Pieces that are not this rank's FSDP rows, and Pieces given to a model that is not
    FSDP of a split one, are refused naming the key and what to pass."""
    name = "blocks.0.attn.qkv.weight"
    runner, _ = _spread(_model(), "fsdp-tp", 2, 2)
    state = get_model_state_dict(runner)
    first = state[name].pieces[:1]  # one of this rank's two boxes
    errors = []
    for model, value in (
        (runner, checkpoint.Pieces((3, 32, 32), first)),
        (_model(), state[name]),
    ):
        try:
            set_model_state_dict(model, {**get_model_state_dict(model), name: value})
        except ValueError as e:
            errors.append(str(e))
    return errors, [(o, a.shape) for o, a in state[name].pieces]


def test_pieces_of_another_layout_are_refused():
    for rank, (errors, boxes) in enumerate(run_ranks(_pieces_refused, 4)):
        mismatch, elsewhere = errors
        assert mismatch.startswith(f"rank {rank}: 'blocks.0.attn.qkv.weight' is Pieces of")
        assert f"this rank's FSDP rows of its tensor-parallel piece are the boxes {boxes}" in (
            mismatch
        )
        assert elsewhere.startswith(f"rank {rank}: 'blocks.0.attn.qkv.weight' is a checkpoint")
        assert "only a split parameter under FSDP takes" in elsewhere


def _full_state(how: str, dp: int, tp: int, uneven: bool):
    model = _model() if not uneven else _odd_model()
    want = model.state_dict()
    runner, _ = _spread(model, how, dp, tp)
    return want, get_model_state_dict(runner, full_state_dict=True)


def _odd_model():
    """Sizes that split unevenly: 5 heads of 4 over 2 or 4 ranks would not divide, so 6 heads
    of 2 (an embedding of 12) over 2, and FSDP rows of 3 * 12 / 2 = 18 over 4 data ranks."""
    config = nn.GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=6, n_embd=12, block_size=8)
    return nn.GPT(config, dtype=np.float64, rng=3)


@pytest.mark.parametrize(
    "how, dp, tp, uneven",
    [
        ("none", 1, 1, False),
        ("ddp", 2, 1, False),
        ("tp", 1, 4, False),
        ("tp", 2, 2, False),
        ("fsdp", 3, 1, False),
        ("fsdp-tp", 2, 2, False),
        ("fsdp-tp", 1, 2, False),
        ("fsdp-tp", 4, 2, True),
    ],
)
def test_a_full_state_dict_is_the_one_process_model_in_every_layout(how, dp, tp, uneven):
    """torch's ``full_state_dict=True``: every rank gets the whole arrays, in the model's own
    shapes, equal to the unsplit model's (FSDP's rows and tensor-parallel pieces gathered)."""
    for want, got in run_ranks(_full_state, dp * tp, args=(how, dp, tp, uneven)):
        assert set(got) == set(want)
        for name, value in got.items():
            assert value.shape == want[name].shape, name
            np.testing.assert_array_equal(value, want[name], err_msg=name)


def _full_states_after_two_steps(how: str, dp: int, tp: int):
    model = _model()
    runner, me = _spread(model, how, dp, tp)
    opt = nn.AdamW(runner.parameters() if how.startswith("fsdp") else model.parameters(), lr=1e-2)
    _steps(runner, opt, range(2), dp, me)
    model_state = get_model_state_dict(runner, full_state_dict=True)
    return model_state, get_optimizer_state_dict(runner, opt, full_state_dict=True)


@pytest.mark.parametrize(
    "how, dp, tp", [("tp", 2, 2), ("ddp", 2, 1), ("fsdp", 2, 1), ("fsdp-tp", 2, 2)]
)
def test_full_optimizer_state_after_training_is_the_one_process_state(how, dp, tp):
    """Two steps in any layout, then the whole parameters and optimizer moments on every rank:
    those of two steps in one process (so every piece and row is gathered into its place)."""
    [(want_model, want_optim)] = run_ranks(_full_states_after_two_steps, 1, args=("none", 1, 1))
    world = dp * tp
    if how == "fsdp":  # every rank the whole batch (see _spread)
        dp = 1
    for got_model, got_optim in run_ranks(_full_states_after_two_steps, world, args=(how, dp, tp)):
        for name, value in want_model.items():
            np.testing.assert_allclose(got_model[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
        assert set(got_optim["state"]) == set(want_optim["state"])
        assert got_optim["step_count"] == want_optim["step_count"] == 2
        for name, entry in want_optim["state"].items():
            for key, value in entry.items():
                np.testing.assert_allclose(
                    got_optim["state"][name][key], value, rtol=1e-9, atol=1e-12,
                    err_msg=f"{name} {key}",
                )  # fmt: skip


def _sharded_below_the_root():
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    opt = nn.AdamW(model.parameters(), lr=1e-2)
    errors = []
    for call in (
        lambda: get_model_state_dict(model),
        lambda: get_model_state_dict(model, full_state_dict=True),
        lambda: get_optimizer_state_dict(model, opt),
        lambda: set_model_state_dict(model, {}),
    ):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_a_model_sharded_below_its_root_is_refused():
    """Each rank's rows of a block that fully_shard split would pass for whole arrays."""
    for rank, errors in enumerate(run_ranks(_sharded_below_the_root, 2)):
        assert len(errors) == 4, errors
        for error in errors:
            assert (
                error.startswith(f"rank {rank}: parameter 'blocks.0.")
                and "fully_shard the root" in error
            )


def _offloaded_after_two_steps(how: str, dp: int, tp: int):
    model = _model()
    runner, me = _spread(model, how, dp, tp)
    opt = nn.AdamW(runner.parameters() if how.startswith("fsdp") else model.parameters(), lr=1e-2)
    _steps(runner, opt, range(2), dp, me)
    model_state = get_model_state_dict(runner, full_state_dict=True, cpu_offload=True)
    optim_state = get_optimizer_state_dict(runner, opt, full_state_dict=True, cpu_offload=True)
    try:
        get_model_state_dict(runner, cpu_offload=True)
        alone = None
    except ValueError as e:
        alone = str(e)
    return model_state, optim_state, alone


@pytest.mark.parametrize("how, dp, tp", [("tp", 2, 2), ("fsdp-tp", 2, 2)])
def test_cpu_offload_keeps_the_full_state_on_rank_0_only(how, dp, tp):
    """torch's cpu_offload with full_state_dict: rank 0 gets one process's state, the other
    ranks ``{}``; cpu_offload alone is refused on every rank."""
    [(want_model, want_optim)] = run_ranks(_full_states_after_two_steps, 1, args=("none", 1, 1))
    results = run_ranks(_offloaded_after_two_steps, dp * tp, args=(how, dp, tp))
    (model_state, optim_state, _), rest = results[0], results[1:]
    assert all(m == {} and o == {} for m, o, _ in rest)
    for name, value in want_model.items():
        np.testing.assert_allclose(model_state[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
    for name, entry in want_optim["state"].items():
        for key, value in entry.items():
            np.testing.assert_allclose(
                optim_state["state"][name][key], value, rtol=1e-9, atol=1e-12
            )
    for rank, (_, _, alone) in enumerate(results):
        assert alone.startswith(f"rank {rank}: cpu_offload=True") and "full_state_dict" in alone
