"""DTensor and tensor parallelism on cupy: every redistribute pair (even, uneven and zero-size
shards, the in-place and out-of-place all-reduce) equals numpy and keeps its pieces on the GPU;
operations, reductions, matmul, an asynchronous redistribute, from_local's check and gradient
clipping give numpy's values; and a tensor-parallel transformer block gives the unsplit block's
outputs and gradients, its state dict (cupy DTensors) loads back, and a table and a loss split
by vocabulary give numpy's rows, loss and gradient.

Multi-rank runs use ucc (two or four processes sharing the one GPU through CUDA IPC); NCCL
cannot put two ranks on one GPU, so it runs the same checks at world size 1.
``scripts/gpu-checks.sh`` runs these on a GPU machine; elsewhere they skip with the reason."""

from __future__ import annotations

import copy

import numpy as np
import pluribus as pb
import pytest
from pluribus import nn
from pluribus.dtensor import (
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
    randn,
    random,
    split_sizes,
    zeros,
)
from pluribus.parallel import (
    RowwiseParallel,
    VocabParallelCrossEntropyLoss,
    full_parameter,
    get_model_state_dict,
    parallelize_module,
    set_model_state_dict,
    transformer_plan,
)
from pluribus.testing import needs_gpu, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

UCC_CUDA = {"ucc_cuda": True}
NCCL = "cpu:gloo,cuda:nccl"

#: Chains of placements over a 1-d mesh: every pair the plan knows, each entry (placements,
#: donate). The shapes below make the shards uneven, and (3, 7) over a 4-rank 1-d mesh has a
#: zero-size one.
CHAINS_1D = [
    [((Shard(0),), False), ((Replicate(),), False)],  # all-gather, uneven
    [((Shard(1),), False), ((Shard(0),), False), ((Shard(1),), False)],  # all-to-all both ways
    [((Partial("sum"),), False), ((Replicate(),), False)],  # out-of-place all-reduce
    [((Partial("sum"),), True), ((Replicate(),), False)],  # in place
    [((Partial("max"),), False), ((Shard(0),), False)],  # reduce-scatter
    [((Partial("avg"),), False), ((Shard(1),), False), ((Replicate(),), False)],
    [((Replicate(),), False), ((Shard(1),), False), ((Partial("sum"),), False)],  # local steps
]
#: Over a 2 x 2 mesh.
CHAINS_2D = [
    [((Shard(0), Shard(1)), False), ((Replicate(), Replicate()), False)],
    [((Partial("sum"), Shard(0)), False), ((Shard(1), Replicate()), False)],
    [((Shard(1), Partial("sum")), True), ((Shard(0), Shard(1)), False)],
    [((Replicate(), Shard(0)), False), ((Shard(0), Replicate()), False)],
]


def _redistribute_on_cupy(mesh_shape: tuple[int, ...], chains, shapes) -> int:
    """Run every chain on every shape and compare each result with numpy; returns the number
    of redistributes checked."""
    import cupy

    mesh = init_device_mesh("cuda", mesh_shape)
    checked = 0
    for shape in shapes:
        for chain in chains:
            reference = np.random.default_rng(checked).integers(-9, 9, shape).astype(np.float64)
            x = distribute_tensor(cupy.asarray(reference), mesh, chain[0][0])
            for (target, _), (_, donate) in zip(chain[1:], chain[:-1], strict=True):
                before = x.to_local().copy()
                y = x.redistribute(placements=target, donate=donate)
                local = y.to_local()
                assert isinstance(local, cupy.ndarray), type(local)
                if not donate:
                    assert bool((x.to_local() == before).all()), "the source changed"
                if not any(isinstance(p, Partial) for p in target):
                    want = reference[y.layout.local_slices(mesh.coordinate)]
                    np.testing.assert_allclose(cupy.asnumpy(local), want, rtol=0, atol=1e-9)
                x = y
                checked += 1
            whole = x.full_tensor()
            assert isinstance(whole, cupy.ndarray)
            np.testing.assert_allclose(cupy.asnumpy(whole), reference, rtol=0, atol=1e-9)
    return checked


@needs_gpu("ucc")
@pytest.mark.parametrize(
    "world, mesh_shape, chains",
    [(2, (2,), CHAINS_1D), (4, (4,), CHAINS_1D), (4, (2, 2), CHAINS_2D)],
)
def test_every_redistribute_on_cupy_over_ucc_equals_numpy(world, mesh_shape, chains):
    shapes = [(5, 6), (3, 7), (world * 4, 8)]  # uneven (zero-size at 4 ranks on 1-d), even
    counts = run_ranks(
        _redistribute_on_cupy, world, "ucc", "processes", timeout=300,
        backend_options=UCC_CUDA, args=(mesh_shape, chains, shapes),
    )  # fmt: skip
    assert counts == [len(shapes) * sum(len(c) - 1 for c in chains)] * world


@needs_gpu("nccl")
def test_every_redistribute_on_cupy_over_nccl_at_world_size_one_equals_numpy():
    counts = run_ranks(
        _redistribute_on_cupy, 1, NCCL, "processes", timeout=300,
        args=((1,), CHAINS_1D, [(5, 6), (0, 3)]),
    )  # fmt: skip
    assert counts == [2 * sum(len(c) - 1 for c in CHAINS_1D)]


def _operations_on_cupy() -> bool:
    """Operations, reductions, matmul, a cupy 0-d scalar, an asynchronous redistribute,
    from_local's check and gradient clipping on cupy pieces, against numpy."""
    import cupy
    from pluribus.dtensor import from_local
    from pluribus.parallel import MLPParallel, clip_grad_norm_

    mesh = init_device_mesh("cuda", (pb.get_world_size(),))
    rows = np.arange(24.0).reshape(6, 4)
    x = distribute_tensor(cupy.asarray(rows), mesh, [Shard(0)])
    ones = distribute_tensor(cupy.ones((4, 3)), mesh, [Replicate()])
    checks = {
        "sum over the sharded axis": (x.sum(axis=0), rows.sum(axis=0)),
        "max": (x.max(), rows.max()),
        "mean over rows": (x.mean(axis=1), rows.mean(axis=1)),
        "scalars": (x * 2.0 - 1.0, rows * 2 - 1),
        "ufunc": (np.exp(x / 24.0), np.exp(rows / 24)),
        "transpose": (x.T, rows.T),
        "matmul": (x @ ones, rows @ np.ones((4, 3))),
        "a cupy 0-d scalar": (x / cupy.asarray(rows).sum(), rows / rows.sum()),
    }
    for name, (got, want) in checks.items():
        whole = got.full_tensor()
        assert isinstance(whole, cupy.ndarray), name
        np.testing.assert_allclose(cupy.asnumpy(whole), want, rtol=1e-12, err_msg=name)
    pending = x.redistribute(placements=[Replicate()], async_op=True)
    np.testing.assert_array_equal(cupy.asnumpy(pending.to_local()), rows)
    assert from_local(x.to_local(), mesh, [Shard(0)]).layout == x.layout
    model = nn.Sequential(
        nn.Linear(4, 3, dtype=np.float64, rng=1),
        nn.Tanh(),
        nn.Linear(3, 2, dtype=np.float64, rng=2),
    )
    reference = copy.deepcopy(model)
    model.to(device="cuda")
    parallelize_module(model, mesh, MLPParallel())
    inputs = np.random.default_rng(3).normal(size=(5, 4))
    reference.backward(np.ones_like(reference.forward(inputs)))
    want = sum(float((p.grad**2).sum()) for p in reference.parameters()) ** 0.5
    model.backward(cupy.ones_like(model.forward(cupy.asarray(inputs))))
    assert clip_grad_norm_(model.parameters(), 0.1) == pytest.approx(want, rel=1e-10)
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        got = cupy.asnumpy(full_parameter(p, grad=True))
        np.testing.assert_allclose(got, q.grad * 0.1 / (want + 1e-6), rtol=1e-10, err_msg=name)
    return True


@needs_gpu("ucc")
def test_operations_on_cupy_over_ucc_equal_numpy():
    assert run_ranks(
        _operations_on_cupy, 2, "ucc", "processes", timeout=300, backend_options=UCC_CUDA
    ) == [True, True]


@needs_gpu("nccl")
@pytest.mark.parametrize("backend", [NCCL, "nccl"])  # an nccl-only world: from_local's check too
def test_operations_on_cupy_over_nccl_at_world_size_one_equal_numpy(backend):
    assert run_ranks(_operations_on_cupy, 1, backend, "processes", timeout=300) == [True]


def _block_on_cupy() -> bool:
    import cupy

    mesh = init_device_mesh("cuda", (pb.get_world_size(),), mesh_dim_names=("tp",))
    block = nn.TransformerBlock(32, 4, dtype=np.float64, rng=1)
    reference = copy.deepcopy(block)
    block.to(device="cuda")
    parallelize_module(block, mesh, transformer_plan(block))
    rng = np.random.default_rng(2)
    x, grad = rng.normal(size=(2, 5, 32)), rng.normal(size=(2, 5, 32))
    want_y = reference.forward(x)
    want_gx = reference.backward(grad)
    y = block.forward(cupy.asarray(x))
    gx = block.backward(cupy.asarray(grad))
    assert isinstance(y, cupy.ndarray) and isinstance(gx, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(y), want_y, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(cupy.asnumpy(gx), want_gx, rtol=1e-10, atol=1e-12)
    for (name, p), (_, q) in zip(
        block.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert isinstance(p.data, cupy.ndarray), name
        np.testing.assert_array_equal(cupy.asnumpy(full_parameter(p)), q.data, err_msg=name)
        got = cupy.asnumpy(full_parameter(p, grad=True))
        np.testing.assert_allclose(got, q.grad, rtol=1e-10, atol=1e-12, err_msg=name)
    # the state dict of a split block on the GPU: DTensors of cupy pieces (the fused q, k, v
    # blocks first), loaded back from whole numpy arrays and from itself
    state = get_model_state_dict(block)
    qkv = state["attn.qkv.weight"]
    assert qkv.shape == (3, 32, 32) and isinstance(qkv.to_local(), cupy.ndarray)
    shifted = {name: value + 1 for name, value in reference.state_dict().items()}
    set_model_state_dict(block, shifted)
    for name, p in block.named_parameters():
        np.testing.assert_array_equal(cupy.asnumpy(full_parameter(p)), shifted[name], name)
    set_model_state_dict(block, state)
    for (name, p), (_, q) in zip(
        block.named_parameters(), reference.named_parameters(), strict=True
    ):
        np.testing.assert_array_equal(cupy.asnumpy(full_parameter(p)), q.data, err_msg=name)
    made = zeros(5, 3, device_mesh=mesh, placements=[Shard(0)], dtype=np.float64)
    assert isinstance(made.to_local(), cupy.ndarray) and not made.full_tensor().any()
    # a random array on a cuda mesh: cupy pieces of the one stream
    drawn = randn(5, 3, device_mesh=mesh, placements=[Shard(1)], dtype=np.float64, seed=9)
    whole = random.piece(9, (5, 3), (0, 0), (5, 3), np.dtype(np.float64), normal=True)
    assert isinstance(drawn.to_local(), cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(drawn.full_tensor()), whole)
    # a table and a loss split by vocabulary (11 classes: uneven over 2 ranks)
    table = nn.Embedding(11, 4, dtype=np.float64, rng=4)
    whole_table = table.weight.data.copy()
    table.to(device="cuda")
    parallelize_module(table, mesh, RowwiseParallel(input_layouts=Replicate()))
    ids = np.array([[0, 5, 10, 6]])
    looked_up = table.forward(cupy.asarray(ids))
    assert isinstance(looked_up, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(looked_up), whole_table[ids])
    logits = np.random.default_rng(5).normal(size=(4, 11))
    labels = np.array([0, 5, 10, -100])
    want = nn.CrossEntropyLoss(label_smoothing=0.1)
    want_loss, want_grad = float(want.forward(logits, labels)), want.backward()
    part = split_sizes(11, mesh.size())
    start = sum(part[: mesh.get_local_rank()])
    mine = slice(start, start + part[mesh.get_local_rank()])
    loss = VocabParallelCrossEntropyLoss(mesh, label_smoothing=0.1)
    got = loss.forward(cupy.asarray(logits[:, mine]), cupy.asarray(labels))
    assert float(got) == pytest.approx(want_loss, rel=1e-12)
    np.testing.assert_allclose(cupy.asnumpy(loss.backward()), want_grad[:, mine], atol=1e-14)
    return True


@needs_gpu("ucc")
def test_tensor_parallel_block_on_cupy_over_ucc_equals_the_block():
    assert run_ranks(
        _block_on_cupy, 2, "ucc", "processes", timeout=300, backend_options=UCC_CUDA
    ) == [True, True]


@needs_gpu("nccl")
def test_tensor_parallel_block_on_cupy_over_nccl_at_world_size_one_equals_the_block():
    assert run_ranks(_block_on_cupy, 1, NCCL, "processes", timeout=300) == [True]
