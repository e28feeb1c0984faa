"""DTensor and tensor parallelism on cupy: every redistribute pair (even and uneven shards, the
in-place and out-of-place all-reduce) equals numpy and keeps its pieces on the GPU, and a
tensor-parallel transformer block gives the unsplit block's outputs and gradients.

Multi-rank runs use ucc (two or four processes sharing the one GPU through CUDA IPC); NCCL
cannot put two ranks on one GPU, so it runs the same checks at world size 1.
``scripts/gpu-checks.sh`` runs these on a GPU machine; elsewhere they skip with the reason."""

from __future__ import annotations

import copy

import numpy as np
import pluribus as pb
import pytest
from pluribus import nn
from pluribus.dtensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from pluribus.parallel import full_parameter, parallelize_module, transformer_plan
from pluribus.testing import needs_gpu, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

UCC_CUDA = {"ucc_cuda": True}
NCCL = "cpu:gloo,cuda:nccl"

#: Chains of placements over a 1-d mesh: every pair the plan knows, each entry (placements,
#: donate). Shapes below make the shards uneven and include a zero-size one at 4 ranks.
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
@pytest.mark.parametrize("world", [2, 4])
def test_every_redistribute_on_cupy_over_ucc_equals_numpy(world):
    shapes = [(5, 6), (3, 7), (world * 4, 8)]  # uneven (a zero-size shard at 4), even
    chains, mesh_shape = (CHAINS_1D, (world,)) if world == 2 else (CHAINS_2D, (2, 2))
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
    return True


@needs_gpu("ucc")
def test_tensor_parallel_block_on_cupy_over_ucc_equals_the_block():
    assert run_ranks(
        _block_on_cupy, 2, "ucc", "processes", timeout=300, backend_options=UCC_CUDA
    ) == [True, True]


@needs_gpu("nccl")
def test_tensor_parallel_block_on_cupy_over_nccl_at_world_size_one_equals_the_block():
    assert run_ranks(_block_on_cupy, 1, NCCL, "processes", timeout=300) == [True]
