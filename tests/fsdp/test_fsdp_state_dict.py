"""State dicts keyed by parameter name: the sharded ones hold DTensors (``Shard(0)``, global
shape kept) for parameters and optimizer state, with ``step`` as a plain number; the full ones
are whole arrays on rank 0. Saving after two steps and loading into a fresh model, under the
same or another strategy, then training a third step equals three steps of single-process
training."""

import numpy as np
import pluribus
import pytest
from fsdp_cases import (
    MODELS,
    _grad,
    _loss,
    global_batch,
    make_optimizer,
    reference_train,
    shard_model,
)
from pluribus import nn
from pluribus.dtensor import DTensor, Shard
from pluribus.parallel.fsdp import (
    full_optim_state_dict,
    load_optim_state_dict,
    optim_state_dict,
)
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

PER_RANK = 4


def _step(model, opt, step, world, rank):
    loss_fn = nn.CrossEntropyLoss()
    x, y = global_batch("gpt", step, 0, world * PER_RANK)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    logits = model.forward(x[mine])
    _loss(loss_fn, logits, y[mine])
    model.backward(_grad(loss_fn, logits))
    opt.step()
    opt.zero_grad()


def save_and_resume_on_rank(first, second, full):
    rank, world = pluribus.get_rank(), pluribus.get_world_size()
    model = shard_model(MODELS["gpt"](), "gpt", first, world)
    opt = make_optimizer(model.parameters())
    for step in range(2):
        _step(model, opt, step, world, rank)
    sharded, osd = model.state_dict(), optim_state_dict(model, opt)
    checks = {
        "placements": {str(d.placements) for d in sharded.values() if isinstance(d, DTensor)},
        "shapes": {k: d.shape for k, d in sharded.items()},
        "osd_kinds": {
            k: type(v).__name__ for k, v in osd["state"]["blocks.0.attn.qkv.weight"].items()
        },
        "osd_layout_same": all(
            osd["state"][name]["exp_avg"].layout == sharded[name].layout for name in sharded
        ),
        "full_osd": full_optim_state_dict(model, opt),
    }
    if full:  # whole arrays, the same on every rank
        state = pluribus.broadcast_object(model.full_state_dict() or None, src=0)
        osd = pluribus.broadcast_object(full_optim_state_dict(model, opt) or None, src=0)
    else:
        state = sharded
    fresh = shard_model(MODELS["gpt"](seed=7), "gpt", second, world)
    fresh_opt = make_optimizer(fresh.parameters())
    fresh.load_state_dict(state)
    load_optim_state_dict(fresh, fresh_opt, osd)
    _step(fresh, fresh_opt, 2, world, rank)
    checks["final"] = fresh.full_state_dict()
    return checks


@pytest.mark.parametrize(
    "first,second,full",
    [
        ("full_shard", "full_shard", False),
        ("full_shard", "no_shard", False),  # another layout: loaded through redistribute
        ("shard_grad_op", "shard_optimizer_state", True),
    ],
)
def test_save_then_resume_equals_uninterrupted_training(first, second, full):
    world = 2
    results = run_ranks(save_and_resume_on_rank, world, "threads", args=(first, second, full))
    reference = reference_train("gpt", world, PER_RANK, 3)
    two_steps = _reference_optimizer_after("gpt", world, 2)
    for result in results:
        assert result["placements"] == {str((Shard(0),))}
        assert result["shapes"] == {k: v.shape for k, v in reference["state"].items()}
        assert result["osd_kinds"] == {"exp_avg": "DTensor", "exp_avg_sq": "DTensor", "step": "int"}
        assert result["osd_layout_same"]
    full_osd = results[0]["full_osd"]
    assert results[1]["full_osd"] == {}
    for name, entry in two_steps.items():
        for key, value in entry.items():
            np.testing.assert_allclose(
                full_osd["state"][name][key], value, rtol=1e-4, atol=1e-6, err_msg=name
            )
    for name, value in results[0]["final"].items():
        np.testing.assert_allclose(
            value, reference["state"][name], rtol=1e-4, atol=1e-5, err_msg=name
        )


def _reference_optimizer_after(model_name, world, steps):
    model = MODELS[model_name]()
    opt, loss_fn = make_optimizer(model.parameters()), nn.CrossEntropyLoss()
    for step in range(steps):
        x, y = global_batch(model_name, step, 0, world * PER_RANK)
        logits = model.forward(x)
        _loss(loss_fn, logits, y)
        model.backward(_grad(loss_fn, logits))
        opt.step()
        opt.zero_grad()
    names = [name for name, _ in model.named_parameters()]
    return dict(zip(names, opt.state, strict=True))


def load_from_reversed_mesh_on_rank():
    """A DTensor on the world's ranks in reverse order: the same layout as the unit's own, other
    rows on each rank."""
    from pluribus.dtensor import DeviceMesh, distribute_tensor
    from pluribus.parallel import fully_shard

    full = np.arange(12.0).reshape(4, 3)
    model = fully_shard(nn.Sequential(nn.Linear(3, 4, dtype=np.float64, rng=0)))
    reversed_mesh = DeviceMesh("cpu", list(reversed(range(pluribus.get_world_size()))))
    state = model.state_dict()
    state["0.weight"] = distribute_tensor(full, reversed_mesh, [Shard(0)])
    model.load_state_dict(state)
    return model.full_state_dict().get("0.weight")


def test_a_dtensor_on_a_mesh_of_other_rank_order_loads_its_own_rows():
    loaded = run_ranks(load_from_reversed_mesh_on_rank, 2, "threads")[0]
    np.testing.assert_array_equal(loaded, np.arange(12.0).reshape(4, 3))
