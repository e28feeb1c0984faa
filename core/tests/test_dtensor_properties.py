"""Property tests: random meshes, shapes (smaller than the mesh and zero included), placements
and redistribute chains on the threads backend. Every result equals a numpy reference computed
in one process, and the collectives each rank issues are exactly its plan's."""

from __future__ import annotations

import math

import numpy as np
import pluribus as pb
import pytest
from dtensor_helpers import CountingPlugin
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pluribus.dtensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    from_local,
    init_device_mesh,
    split_sizes,
)
from pluribus.testing import run_ranks

MESHES = [(1,), (2,), (3,), (4,), (2, 2), (3, 2), (1, 4), (2, 4), (2, 2, 2), (1, 2, 3)]


@pytest.fixture(scope="module")
def counting():
    plugin = CountingPlugin()
    manager = pb.get_plugin_manager()
    manager.register(plugin, name="test-dtensor-counting")
    yield plugin
    manager.unregister(name="test-dtensor-counting")


@st.composite
def placements(draw, mesh_ndim: int, ndim: int):
    out, used = [], set()
    for _ in range(mesh_ndim):
        kind = draw(st.sampled_from(["shard", "replicate", "partial"] if ndim else ["r", "p"]))
        if kind == "shard":
            dim = draw(st.integers(0, ndim - 1))
            out.append(Replicate() if dim in used else Shard(dim))
            used.add(dim)
        elif kind in ("partial", "p"):
            out.append(Partial(draw(st.sampled_from(["sum", "avg", "max", "min"]))))
        else:
            out.append(Replicate())
    ops = [p.op for p in out if isinstance(p, Partial)]
    if len(set(ops)) > 1 and not set(ops) <= {"sum", "avg"}:  # refused: order matters
        out = [Partial(ops[0]) if isinstance(p, Partial) else p for p in out]
    return out


@st.composite
def cases(draw):
    mesh = draw(st.sampled_from(MESHES))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    chain = draw(st.lists(placements(len(mesh), len(shape)), min_size=2, max_size=4))
    donate = draw(st.lists(st.booleans(), min_size=len(chain), max_size=len(chain)))
    noise = draw(st.lists(st.booleans(), min_size=len(chain), max_size=len(chain)))
    return mesh, shape, chain, donate, noise, draw(st.integers(0, 2**16))


def _noisy(dt: DTensor, seed: int) -> DTensor:
    """The same DTensor with different Partial terms: noise that cancels along each Partial
    mesh dimension (sum, avg) or stays below the kept value (max) / above it (min)."""
    mesh, local = dt.device_mesh, dt.to_local().copy()
    coord = mesh.coordinate
    for m, p in enumerate(dt.placements):
        if not isinstance(p, Partial):
            continue

        def noise(k, m=m, shape=local.shape):
            c = list(coord)
            c[m] = k
            rng = np.random.default_rng([seed, m, *c])
            return rng.integers(0, 5, shape).astype(np.float64)

        if p.op in ("sum", "avg"):
            if coord[m] == 0:
                local -= sum(noise(k) for k in range(1, mesh.shape[m]))
            else:
                local += noise(coord[m])
        elif coord[m] != 0:
            local += -noise(coord[m]) if p.op == "max" else noise(coord[m])
    return DTensor(local, mesh, dt.layout)


def _check_chain(mesh_shape, shape, chain, donate, noise, seed, counting):
    """Each step's result against numpy, its collectives against its plan; and at the end,
    every DTensor not donated still holds its piece (a later donation wrote nothing it held).
    Noise, where drawn, gives the next step's Partial terms other values than the plan made
    (it copies the piece: steps without it donate what the step before returned)."""
    rank = pb.get_rank()
    mesh = init_device_mesh("cpu", mesh_shape)
    reference = np.random.default_rng(seed).integers(-9, 9, shape).astype(np.float64)
    x = _noisy(distribute_tensor(reference, mesh, chain[0]), seed)
    kept, donated = [], []
    for k, (target, give) in enumerate(zip(chain[1:], donate, strict=False)):
        plan = x.redistribute_plan(target, donate=give)
        before = x.to_local().copy()
        mark = counting.mark(rank)
        y = x.redistribute(placements=target, donate=give, async_op=k % 2 == 1).wait()
        issued = counting.since(rank, mark)
        expected = [
            (name, tuple(mesh.get_group(s.mesh_dim).ranks), nin, nout)
            for s in plan.steps
            for name, nin, nout in s.calls
        ]
        assert issued == expected, f"rank {rank}: plan\n{plan}\nissued {issued}"
        if not give:  # the source stays valid and unchanged
            np.testing.assert_array_equal(x.to_local(), before)
        (donated if give else kept).append((x, before))
        x = y
        assert x.placements == plan.dst.placements
        assert x.shape == shape
        if not any(isinstance(p, Partial) for p in x.placements):
            for m, p in enumerate(x.placements):
                if isinstance(p, Shard):
                    assert x.layout.sizes[m] == split_sizes(shape[p.dim], mesh_shape[m])
            want = reference[x.layout.local_slices(mesh.coordinate)]
            np.testing.assert_allclose(x.to_local(), want, rtol=0, atol=1e-9)  # avg: /3
        if noise[k]:
            x = _noisy(x, seed + 1)  # Partial terms differ from the ones the plan made
    np.testing.assert_allclose(x.full_tensor(), reference, rtol=0, atol=1e-9)
    gone = {id(dt) for dt, _ in donated}  # a plan with no step hands back its source
    for dt, piece in kept:
        if id(dt) not in gone:
            np.testing.assert_array_equal(dt.to_local(), piece)
    return True


@pytest.mark.timeout(120)
@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(cases())
def test_redistribute_chains_match_numpy_and_issue_exactly_the_plan(counting, case):
    mesh_shape, shape, chain, donate, noise, seed = case
    world = math.prod(mesh_shape)
    args = (mesh_shape, shape, chain, donate, noise, seed, counting)
    assert run_ranks(_check_chain, world, args=args) == [True] * world


SCALAR_OPS = {
    "add": lambda x, y: x + y,
    "sub": lambda x, y: x - y,
    "mul": lambda x, y: x * y,
    "div": lambda x, y: x / y,
}


def _check_ops(mesh_shape, shape, pa, pa_any, seed):
    mesh = init_device_mesh("cpu", mesh_shape)
    rng = np.random.default_rng(seed)
    a_ref = rng.integers(-9, 9, shape).astype(np.float64)
    b_ref = rng.integers(-9, 9, shape).astype(np.float64)
    a = distribute_tensor(a_ref, mesh, pa)
    b = distribute_tensor(b_ref, mesh, pa)
    np.testing.assert_array_equal((a + b * 2 - b).full_tensor(), a_ref + b_ref * 2 - b_ref)
    np.testing.assert_array_equal((-a).full_tensor(), -a_ref)
    # with a scalar on either side, on terms that differ between ranks: a wrong result, never
    # a refusal, is the failure (the rules refuse what they cannot do locally)
    terms = _noisy(distribute_tensor(a_ref, mesh, pa_any), seed)

    def quiet():  # c / 0, as numpy's reference does
        return np.errstate(divide="ignore", invalid="ignore")

    for c in (2.5, -1.5):
        for name, op in SCALAR_OPS.items():
            for left in (False, True):
                try:
                    with quiet():
                        got = op(c, terms) if left else op(terms, c)
                except ValueError as refused:
                    assert "would change the reduced value" in str(refused)
                    continue
                with quiet():
                    want = op(c, a_ref) if left else op(a_ref, c)
                np.testing.assert_allclose(
                    got.full_tensor(), want, rtol=1e-12, atol=1e-12, err_msg=name
                )
    for axis in [None, 0, len(shape) - 1]:
        for name in ("sum", "max", "min", "mean"):
            src = (
                a
                if name in ("sum", "mean")
                else distribute_tensor(
                    a_ref, mesh, [p if not isinstance(p, Partial) else Replicate() for p in pa]
                )
            )
            if name in ("max", "min") and (a_ref.size == 0 or 0 in [shape[axis or 0]]):
                continue
            got = getattr(src, name)(axis=axis).full_tensor()
            want = getattr(a_ref, name)(axis=axis)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    return True


@st.composite
def op_cases(draw):
    mesh = draw(st.sampled_from(MESHES[:7]))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    pa_any = draw(placements(len(mesh), len(shape)))  # Partial of any op
    pa = [Partial() if isinstance(p, Partial) else p for p in pa_any]
    return mesh, shape, pa, pa_any, draw(st.integers(0, 2**16))


@pytest.mark.timeout(90)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op_cases())
def test_elementwise_and_reductions_propagate_placements(case):
    mesh_shape, shape, pa, pa_any, seed = case
    world = math.prod(mesh_shape)
    args = (mesh_shape, shape, pa, pa_any, seed)
    assert run_ranks(_check_ops, world, args=args) == [True] * world


def _check_from_local_uneven(sizes):
    rank = pb.get_rank()
    mesh = init_device_mesh("cpu", (len(sizes),))
    offsets = np.cumsum([0, *sizes])
    reference = np.arange(offsets[-1] * 2, dtype=np.float32).reshape(-1, 2)
    local = reference[offsets[rank] : offsets[rank + 1]]
    x = from_local(local, mesh, [Shard(0)])
    assert x.layout.sizes == (tuple(sizes),) and x.shape == reference.shape
    np.testing.assert_array_equal(x.full_tensor(), reference)
    y = x.redistribute(placements=[Shard(0)])  # to the array_split sizes: one all-to-all
    assert y.layout.sizes[0] == split_sizes(offsets[-1], len(sizes))
    np.testing.assert_array_equal(y.full_tensor(), reference)
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sizes", [(5, 0, 0, 0), (0, 1, 3), (2, 2), (1, 0)])
def test_from_local_takes_the_sizes_the_ranks_hold(sizes):
    assert run_ranks(_check_from_local_uneven, len(sizes), args=(sizes,)) == [True] * len(sizes)


@pytest.mark.timeout(120)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(cases())
def test_redistribute_chains_on_a_hybrid_group(counting, case):
    """The same on a world whose groups carry a cpu and a cuda backend (numpy pieces take the
    cpu one): the mesh makes its groups from it like from any other."""
    mesh_shape, shape, chain, donate, noise, seed = case
    world = math.prod(mesh_shape)
    args = (mesh_shape, shape, chain, donate, noise, seed, counting)
    backend = "cpu:threads,cuda:threads"
    assert run_ranks(_check_chain_on_hybrid, world, args=args, backend=backend) == [True] * world


def _check_chain_on_hybrid(*args) -> bool:
    assert sorted(pb.get_default_group().backends) == ["cpu", "cuda"]
    return _check_chain(*args)
