"""The API's edges: manual unshard/reshard, the wrapper form, and bad input refused with an
error naming the rank and what to do."""

import numpy as np
import pluribus
import pytest
from pluribus import nn
from pluribus.mesh import init_device_mesh
from pluribus.parallel import FullyShardedDataParallel, ShardingStrategy, fully_shard
from pluribus.parallel.fsdp import full_optim_state_dict
from pluribus.testing import RanksFailed, run_ranks

pytestmark = pytest.mark.timeout(60)


def unshard_on_rank():
    model = nn.Sequential(nn.Linear(4, 5, rng=0), nn.Tanh(), nn.Linear(5, 3, rng=1))
    whole = {name: p.data.copy() for name, p in model.named_parameters()}
    fully_shard(model[0])
    fully_shard(model)
    shapes = {name: p.data.shape for name, p in model.named_parameters()}
    model.unshard()  # the root's own parameters
    model[0].unshard(async_op=True)
    model[0].unshard()
    gathered = {name: p.data.copy() for name, p in model.named_parameters()}
    model[0].reshard()
    model.reshard()
    after = {name: p.data.shape for name, p in model.named_parameters()}
    return shapes, gathered, after, whole


def test_unshard_gives_whole_parameters_and_reshard_gives_the_rows_back():
    for rank, (shapes, gathered, after, whole) in enumerate(
        run_ranks(unshard_on_rank, 2, "threads")
    ):
        assert shapes == after
        assert shapes["0.weight"] == ((3,) if rank == 0 else (2,)) + (4,)
        for name, value in whole.items():
            np.testing.assert_array_equal(gathered[name], value)


def wrapper_on_rank():
    model = nn.GPT(nn.GPTConfig(**nn.PRESETS["tiny"]), rng=0)
    fsdp = FullyShardedDataParallel(model, sharding_strategy="shard_grad_op")
    units = [u.name for u in fsdp.fsdp_units()]
    names = [name for name, _ in fsdp.named_parameters()]
    return units, names, sorted(fsdp.state_dict())


def test_the_wrapper_makes_each_block_a_unit_and_keeps_the_names():
    units, names, keys = run_ranks(wrapper_on_rank, 2, "threads")[0]
    assert units == ["<root>", "blocks.0", "blocks.1"]
    reference = nn.GPT(nn.GPTConfig(**nn.PRESETS["tiny"]), rng=0)
    assert names == [name for name, _ in reference.named_parameters()]
    assert keys == sorted(reference.state_dict())


def _expect(fn, world, message):
    with pytest.raises(RanksFailed) as failed:
        run_ranks(fn, world, "threads", timeout=20)
    for error in failed.value.errors:
        assert message in error.message, error.message
        assert f"rank {error.rank}" in error.message


def hybrid_without_mesh():
    fully_shard(nn.Linear(4, 4), strategy=ShardingStrategy.HYBRID_SHARD)


def three_d_mesh():
    fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1, 2)))


def twice():
    layer = fully_shard(nn.Linear(4, 4))
    fully_shard(layer)


def different_models():
    width = 4 if pluribus.get_rank() == 0 else 6
    model = fully_shard(nn.Linear(width, 4))
    model.forward(np.ones((1, width), np.float32))


def test_bad_input_is_refused_on_every_rank():
    _expect(hybrid_without_mesh, 2, "HYBRID_SHARD needs a 2-d mesh")
    _expect(three_d_mesh, 2, "FSDP takes a 1-d mesh, or a 2-d one")
    _expect(twice, 2, "fully_shard was already applied")
    _expect(different_models, 2, "FSDP needs the same units on every rank")


def fsdp_over_the_tensor_parallel_ranks():
    """Caught here: a rank that raised first would abort the others while they still split
    the model (which makes the mesh's groups)."""
    from pluribus.parallel import MLPParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(6, 4, rng=1), nn.Tanh(), nn.Linear(4, 3, rng=2))
    parallelize_module(model, mesh["tp"], MLPParallel())
    try:
        fully_shard(model)  # the whole world: the ranks that hold the other pieces
    except ValueError as e:
        return str(e), model.__class__.__name__


def test_fsdp_over_the_ranks_of_the_tensor_parallel_pieces_is_refused():
    """FSDP of a split model shards each piece over the data-parallel slice of the mesh
    (core/tests/test_tensor_parallel.py trains one); over the ranks that hold the other pieces
    it is refused before anything is sharded."""
    for rank, (error, kind) in enumerate(run_ranks(fsdp_over_the_tensor_parallel_ranks, 2)):
        assert error.startswith(f"rank {rank}: fully_shard got '0.weight', split by tensor ")
        assert (
            'sharded over the 1-d data-parallel slice of the same 2-d mesh (mesh=mesh["dp"]'
            in error
        )
        assert kind == "Sequential"  # not an FSDP module


def fsdp_tp_misuse():
    """FSDP's own state dicts and full_parameter on a split model, and an FSDP mesh whose ranks
    hold other pieces (refused at the first forward, before any gradient is averaged)."""
    from pluribus.mesh import DeviceMesh
    from pluribus.parallel import full_parameter, parallelize_module, transformer_plan

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = nn.GPTConfig(vocab_size=16, n_layer=1, n_head=2, n_embd=8, block_size=4)
    errors = []

    def refused(call):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))

    model = nn.GPT(config, rng=0)
    parallelize_module(model, mesh["tp"], transformer_plan(model))
    fully_shard(model, mesh=mesh["dp"])
    opt = nn.AdamW(model.parameters())
    refused(model.state_dict)
    refused(model.full_state_dict)
    refused(lambda: full_optim_state_dict(model, opt))
    refused(lambda: full_parameter(model.blocks[0].attn.qkv.weight))
    crossed = nn.GPT(config, rng=0)
    parallelize_module(crossed, mesh["tp"], transformer_plan(crossed))
    fully_shard(crossed, mesh=DeviceMesh("cpu", [[0, 3], [1, 2]], ("x", "dp"))["dp"])
    refused(lambda: crossed.forward(np.zeros((1, 4), np.int64)))
    return errors


def test_fsdp_of_a_split_model_refuses_what_would_mistake_a_piece_for_the_whole():
    for rank, errors in enumerate(run_ranks(fsdp_tp_misuse, 4)):
        assert all(e is not None and e.startswith(f"rank {rank}: ") for e in errors), errors
        for call, error in zip(
            ["state_dict", "full_state_dict", "full_optim_state_dict"], errors, strict=False
        ):
            assert f"{call} of an FSDP model whose parameters are tensor-parallel pieces" in error
            assert "use pluribus.parallel.get_model_state_dict" in error
        assert "full_parameter of a tensor-parallel piece that FSDP shards" in errors[3]
        assert "FSDP needs the same units on every rank" in errors[4]
        assert "'tensor-parallel piece 0 of 2'" in errors[4] and "piece 1 of 2" in errors[4]
