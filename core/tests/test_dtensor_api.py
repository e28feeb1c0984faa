"""DeviceMesh, DTensor construction, matmul rules, plans and the errors for bad input."""

from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import pluribus as pb
import pytest
from dtensor_helpers import CountingPlugin
from pluribus import nn
from pluribus.dtensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    elementwise,
    from_local,
    init_device_mesh,
    redistribute_plan,
)
from pluribus.dtensor.layout import default_layout
from pluribus.dtensor.plan import CostModel, make_plan
from pluribus.mesh import DeviceMesh
from pluribus.parallel import ColwiseParallel, parallelize_module
from pluribus.testing import RanksFailed, run_ranks


@pytest.fixture
def counting():
    plugin = CountingPlugin()
    manager = pb.get_plugin_manager()
    manager.register(plugin, name="test-dtensor-api-counting")
    yield plugin
    manager.unregister(name="test-dtensor-api-counting")


def _mesh_body():
    mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
    rank = pb.get_rank()
    assert mesh.coordinate == divmod(rank, 3)
    assert mesh.get_local_rank("tp") == rank % 3 and mesh.size("dp") == 2 and mesh.size() == 6
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    assert tp.ranks == [3 * (rank // 3) + i for i in range(3)]
    assert dp.ranks == [rank % 3, rank % 3 + 3]
    again = init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
    assert again.get_group("tp") is tp and mesh["tp"].get_group() is tp
    sub = mesh["tp", "dp"]
    assert sub.shape == (3, 2) and sub.get_group("dp") is dp
    assert mesh["dp"].mesh.tolist() == [rank % 3, rank % 3 + 3]
    # a transposed mesh: the order along a dimension differs from the group's
    odd = DeviceMesh("cpu", [[5, 4, 3], [2, 1, 0]])
    x = distribute_tensor(np.arange(12.0).reshape(6, 2), odd, [Shard(0), Shard(1)])
    np.testing.assert_array_equal(x.full_tensor(), np.arange(12.0).reshape(6, 2))
    return True


@pytest.mark.timeout(60)
def test_mesh_groups_are_made_once_per_rank_set_and_shared_by_slices(counting):
    assert run_ranks(_mesh_body, 6) == [True] * 6
    # per rank: 3 dp groups (2 ranks each) and 2 tp groups, each created once, on its members
    assert counting.groups_created == 6 * 1 + 3 * 2 + 2 * 3


def _mesh_handle_body():
    """A mesh is its own read-only copy of the ranks, copied as itself, and equal only to a
    mesh on the same device."""
    ranks = np.array([[0, 1], [2, 3]])
    rows = DeviceMesh("cpu", ranks, ("a", "b"))
    ranks[:] = ranks.T  # the caller reuses its array for a second mesh
    columns = DeviceMesh("cpu", ranks, ("a", "b"))
    rank = pb.get_rank()
    assert rows.mesh.tolist() == [[0, 1], [2, 3]] and rows.coordinate == divmod(rank, 2)
    assert columns.coordinate == divmod(rank, 2)[::-1]
    with pytest.raises(ValueError, match="read-only"):
        rows["b"].mesh[0] = 3
    whole = np.arange(8.0).reshape(4, 2)
    for mesh in (rows, columns):
        x = distribute_tensor(whole, mesh, [Shard(0), Replicate()])
        np.testing.assert_array_equal(x.full_tensor(), whole)
    assert rows.group_order("b") == rows.group_order(1)
    assert copy.copy(rows) is rows and copy.deepcopy(rows) is rows
    layer = nn.Linear(4, 4)
    parallelize_module(layer, init_device_mesh("cpu", (4,)), ColwiseParallel())
    twin = copy.deepcopy(layer)  # the mesh (and its groups) shared, the arrays copied
    assert twin.weight.tp_layout[0] is layer.weight.tp_layout[0]
    assert twin.weight.data is not layer.weight.data
    np.testing.assert_array_equal(twin.weight.data, layer.weight.data)
    assert init_device_mesh("cpu", (4,)) != init_device_mesh("cuda", (4,))
    return True


@pytest.mark.timeout(60)
def test_a_mesh_owns_its_ranks_and_copies_as_itself():
    assert run_ranks(_mesh_handle_body, 4) == [True] * 4


def _whole_world_mesh():
    init_device_mesh("cpu", (4,)).get_group(0)
    return weakref.ref(pb.get_default_group())


@pytest.mark.timeout(60)
def test_a_mesh_over_the_whole_world_lets_the_world_go():
    worlds = run_ranks(_whole_world_mesh, 4)
    gc.collect()
    assert [w() for w in worlds] == [None] * 4


def _destroyed_group_body():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pb.destroy_process_group(mesh.get_group("tp"))
    # every rank destroyed its tp group: every rank refuses to hand it to a new mesh
    init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).get_group("tp")


@pytest.mark.timeout(60)
def test_a_new_mesh_refuses_a_destroyed_group():
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_destroyed_group_body, 4)
    assert sorted(e.rank for e in failed.value.errors) == [0, 1, 2, 3]
    for e in failed.value.errors:
        assert e.kind == "ValueError" and "was destroyed" in e.message, e.message


def _matmul_body():
    mesh = init_device_mesh("cpu", (2,))
    rng = np.random.default_rng(0)
    x, w1, w2 = rng.normal(size=(3, 4, 6)), rng.normal(size=(6, 8)), rng.normal(size=(8, 6))
    xr = distribute_tensor(x, mesh, [Replicate()])
    h = xr @ distribute_tensor(w1, mesh, [Shard(1)])  # column-parallel
    assert h.placements == (Shard(2),)
    y = h @ distribute_tensor(w2, mesh, [Shard(0)])  # row-parallel
    assert y.placements == (Partial(),)
    np.testing.assert_allclose(y.full_tensor(), x @ w1 @ w2, rtol=1e-12)
    rows = distribute_tensor(x, mesh, [Shard(1)]) @ distribute_tensor(w1, mesh, [Replicate()])
    assert rows.placements == (Shard(1),)
    np.testing.assert_allclose(rows.full_tensor(), x @ w1, rtol=1e-12)
    t = distribute_tensor(w1, mesh, [Shard(0)]).T
    assert t.placements == (Shard(1),) and t.shape == (8, 6)
    np.testing.assert_array_equal(t.full_tensor(), w1.T)
    neg = -(distribute_tensor(w1, mesh, [Partial("max")]))
    assert neg.placements == (Partial("min"),)
    np.testing.assert_array_equal(neg.full_tensor(), -w1)
    with pytest.raises(ValueError, match="mesh dimension 0 has no local rule"):
        distribute_tensor(x, mesh, [Shard(0)]) @ distribute_tensor(w1, mesh, [Shard(0)])
    return True


@pytest.mark.timeout(60)
def test_matmul_follows_the_tensor_parallel_rules():
    assert run_ranks(_matmul_body, 2) == [True, True]


def _plan_body():
    mesh = init_device_mesh("cpu", (2, 2))
    x = distribute_tensor(np.zeros((8, 4), np.float32), mesh, [Partial(), Shard(0)])
    plan = redistribute_plan(x, [Shard(1), Replicate()])
    assert plan is x.redistribute_plan([Shard(1), Replicate()])  # cached per layout pair
    assert [s.kind for s in plan.steps] == ["reduce_scatter", "all_gather"]
    text = str(plan)
    assert "reduce_scatter over 2 ranks, 64 B in, 32 B out" in text
    assert "all_gather over 2 ranks, 32 B in, 64 B out" in text
    assert plan.cost > 0 and redistribute_plan(x, x.placements).steps == ()
    y = x.redistribute(placements=[Replicate(), Replicate()], async_op=True)
    np.testing.assert_array_equal(y.to_local(), np.zeros((8, 4), np.float32))
    ones = distribute_tensor(np.ones(4), mesh, [Partial(), Replicate()])
    piece = ones.to_local()
    kept = ones.redistribute_plan([Replicate(), Replicate()])
    assert kept.steps[0].how == "out of place" and kept.collectives == ["all_reduce_into"]
    donated = ones.redistribute_plan([Replicate(), Replicate()], donate=True)
    assert donated.steps[0].how == "in place" and "out of place" not in str(donated)
    assert donated.collectives == ["all_reduce"]
    summed = ones.redistribute(placements=[Replicate(), Replicate()], donate=True)
    assert summed.to_local() is piece  # reduced in place: no copy
    np.testing.assert_array_equal(piece, np.ones(4))
    with pytest.raises(ValueError, match="donate=True"):
        ones.to_local()
    with pytest.raises(TypeError, match="placements="):
        summed.redistribute([Replicate(), Replicate()])  # the mesh's place, as in torch
    same = summed.redistribute(placements=summed.placements, donate=True)  # nothing to do
    assert same.to_local() is piece
    with pytest.raises(ValueError, match="donate=True"):
        summed.redistribute(placements=[Shard(0), Replicate()])
    return True


def _plan_alone(counting):
    mesh = init_device_mesh("cpu", (2, 2))
    x = distribute_tensor(np.zeros((8, 4), np.float32), mesh, [Partial(), Shard(0)])
    pb.barrier()
    before = counting.groups_created
    if pb.get_rank() == 0:  # one rank alone: reading a plan must not communicate
        assert x.redistribute_plan([Shard(1), Replicate()]).collectives
    pb.barrier()
    assert counting.groups_created == before
    pb.barrier()
    y = x.redistribute(placements=[Shard(1), Replicate()])  # every rank: groups made here
    np.testing.assert_array_equal(y.full_tensor(), np.zeros((8, 4), np.float32))
    return True


@pytest.mark.timeout(60)
def test_a_plan_is_read_without_communicating(counting):
    assert run_ranks(_plan_alone, 4, args=(counting,), timeout=40) == [True] * 4


@pytest.mark.timeout(60)
def test_plans_are_readable_cached_and_shrink_before_they_gather():
    assert run_ranks(_plan_body, 4) == [True] * 4


def _cheapest_order_body():
    """Two orders the planner must get right: mesh dimensions trading tensor dimensions gather
    the one with the smaller group first (the piece grows by its size); an all-to-all that
    shrinks the pieces runs before an all-reduce. Each result against numpy."""
    swap = init_device_mesh("cpu", (4, 2))
    whole = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    x = distribute_tensor(whole, swap, [Shard(0), Shard(1)])
    plan = x.redistribute_plan([Shard(1), Shard(0)])
    assert [(s.kind, s.mesh_dim) for s in plan.steps] == [
        ("all_gather", 1), ("all_to_all", 0), ("shard_local", 1)
    ], str(plan)  # fmt: skip
    y = x.redistribute(placements=[Shard(1), Shard(0)])
    np.testing.assert_array_equal(y.full_tensor(), whole)
    shrink = init_device_mesh("cpu", (2, 4))
    wide = np.arange(5 * 64, dtype=np.float32).reshape(5, 64)  # 5 rows over 4: 2, 1, 1, 1
    z = distribute_tensor(wide, shrink, [Partial(), Shard(0)])
    plan = z.redistribute_plan([Replicate(), Shard(1)])
    assert [s.kind for s in plan.steps] == ["all_to_all", "all_reduce"], str(plan)
    np.testing.assert_array_equal(
        z.redistribute(placements=[Replicate(), Shard(1)]).full_tensor(), wide
    )
    return True


def test_plans_take_the_cheaper_order():
    assert run_ranks(_cheapest_order_body, 8) == [True] * 8


def test_an_uneven_collective_is_predicted_by_its_largest_piece():
    """A ring step of an all-gather or reduce-scatter waits for the largest piece: 5 rows over
    4 ranks (2, 1, 1, 1) cost what 8 rows (2 each) cost, not 5/8 of it."""
    cost, row = CostModel(alpha=1e-6, beta=1e-9), 256 * 4
    for rows in (5, 8):
        sharded = default_layout((rows, 256), (Shard(0),), (4,))
        whole = default_layout((rows, 256), (Replicate(),), (4,))
        partial = default_layout((rows, 256), (Partial(),), (4,))
        for src, dst in ((sharded, whole), (partial, sharded)):
            for coordinate in range(4):
                (step,) = make_plan(src, dst, (4,), (coordinate,), 4, cost).steps
                assert step.seconds == pytest.approx(3 * (1e-6 + 2 * row * 1e-9)), (rows, step)
    # an all-to-all's part: the largest piece's rows of the largest piece's columns
    rows, columns = (default_layout((5, 5), (Shard(d),), (4,)) for d in (0, 1))
    (step,) = make_plan(rows, columns, (4,), (3,), 8, cost).steps
    assert step.seconds == pytest.approx(3 * (1e-6 + 2 * 2 * 8 * 1e-9)), step


def _last_plan_body():
    rank = pb.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    whole = np.arange(24.0).reshape(6, 4)
    x = distribute_tensor(whole, mesh, [Shard(0)])
    for _ in range(2):  # two targets from one layout in turn: each call takes its own plan
        np.testing.assert_array_equal(x.redistribute(placements=[Replicate()]).to_local(), whole)
        columns = x.redistribute(placements=[Shard(1)]).to_local()
        np.testing.assert_array_equal(columns, whole[:, 2 * rank : 2 * rank + 2])
    # the placements spelled as a tuple, then a list, then a tuple again: the same results
    for target in ((Shard(1),), [Shard(1)], (Shard(1),), [Replicate()]):
        expected = whole if target[0] is Replicate() else whole[:, 2 * rank : 2 * rank + 2]
        np.testing.assert_array_equal(x.redistribute(placements=target).to_local(), expected)
    # any sequence of placements will do, a numpy array too (== is elementwise there)
    flat = init_device_mesh("cpu", (1, 2))
    w = distribute_tensor(whole, flat, [Replicate(), Shard(1)])
    spelled = np.array([Replicate(), Shard(0)], dtype=object)
    for _ in range(3):
        rows = w.redistribute(placements=spelled).to_local()
        np.testing.assert_array_equal(rows, whole[3 * rank : 3 * rank + 3])
    # a repeated call from a pending result waits for it; from a donated one refuses
    pending = x.redistribute(placements=[Shard(1)], async_op=True)
    np.testing.assert_array_equal(
        pending.redistribute(placements=[Shard(0)]).to_local(), x.to_local()
    )
    again = x.redistribute(placements=[Shard(1)])
    again.redistribute(placements=[Shard(0)], donate=True)
    with pytest.raises(ValueError, match="given to redistribute\\(donate=True\\)"):
        again.redistribute(placements=[Shard(0)], donate=True)
    # the same layout and target at another dtype: a plan of its own
    x32 = distribute_tensor(whole.astype(np.float32), mesh, [Shard(0)])
    assert x32.layout is x.layout
    for source, dtype in ((x, np.float64), (x32, np.float32), (x, np.float64)):
        full = source.redistribute(placements=[Replicate()]).to_local()
        assert full.dtype == dtype
        np.testing.assert_array_equal(full, whole)
    # donated (in place) and not (into a new array) after each other, from one layout
    term = distribute_tensor(whole, mesh, [Partial()])
    kept = term.to_local().copy()
    for _ in range(2):
        donor = DTensor(kept.copy(), mesh, term.layout)
        np.testing.assert_array_equal(
            donor.redistribute(placements=[Replicate()], donate=True).to_local(), whole
        )
        np.testing.assert_array_equal(term.redistribute(placements=[Replicate()]).to_local(), whole)
        np.testing.assert_array_equal(term.to_local(), kept)
    # the same layout on another mesh, whose order along the dimension differs
    other = DeviceMesh("cpu", [1, 0])
    z = distribute_tensor(whole, other, [Shard(0)])
    assert z.layout is x.layout
    np.testing.assert_array_equal(z.to_local(), whole[3 * (1 - rank) : 3 * (2 - rank)])
    for _ in range(2):
        np.testing.assert_array_equal(z.redistribute(placements=[Replicate()]).to_local(), whole)
        np.testing.assert_array_equal(x.redistribute(placements=[Replicate()]).to_local(), whole)
    return True


@pytest.mark.timeout(60)
def test_a_repeated_redistribute_reuses_a_plan_only_for_the_same_target_array_and_mesh():
    assert run_ranks(_last_plan_body, 2, timeout=40) == [True] * 2


class _DeviceArray(np.ndarray):
    """Taken for a device array: its module's name starts with cupy."""


_DeviceArray.__module__ = "cupy_stand_in"


def _errors(case):
    rank = pb.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    x = np.zeros((4, 2))
    if case == "placements":
        distribute_tensor(x, mesh, [Shard(0), Replicate()])
    elif case == "dim":
        distribute_tensor(x, mesh, [Shard(2)])
    elif case == "from_local":
        from_local(np.zeros((2, 2 + rank)), mesh, [Shard(0)])
    elif case == "from_local ndim":  # rank 0's own check refuses Shard(2) of its 2-d piece
        from_local(np.zeros((2, 2) + (2,) * rank), mesh, [Shard(2)])
    elif case == "from_local placements":
        from_local(np.zeros((2, 2)), mesh, [Shard(1 - rank)])
    elif case == "from_local shape":  # one rank's shape= is wrong
        from_local(np.zeros((2, 2)), mesh, [Shard(0)], shape=(5, 2) if rank == 0 else None)
    elif case == "from_local device":  # a device array on rank 0 (device_of reads the module)
        piece = np.zeros((2, 2))
        from_local(piece.view(_DeviceArray) if rank == 0 else piece, mesh, [Shard(0)])
    elif case == "from_local refused":  # the same bad placements on every rank
        from_local(np.zeros((2, 2)), mesh, [Shard(0), Replicate()])
    elif case == "two meshes":
        other = DeviceMesh("cpu", [1, 0])
        distribute_tensor(x, mesh, [Replicate()]) + distribute_tensor(x, other, [Replicate()])
    elif case == "not in mesh":
        DeviceMesh("cpu", [0])
    elif case == "mesh shape":
        init_device_mesh("cpu", (3,))
    elif case == "partial":
        distribute_tensor(x, mesh, [Partial()]) + 1.0
    elif case == "slice by number":
        init_device_mesh("cpu", (2,))[0]
    elif case == "shape below 1":
        init_device_mesh("cpu", (-2, -1))
    elif case == "ranks not integers":
        DeviceMesh("cpu", [0.9, 1.5])
    elif case == "device":
        DeviceMesh("gpu", [0, 1])
    elif case == "names a string":
        DeviceMesh("cpu", [0, 1], "ab")
    elif case == "complex partial":
        from_local(np.ones(2, np.complex128), mesh, [Partial("max")], run_check=False)
    elif case == "avg of ints":  # an average of integers is no integer
        distribute_tensor(np.arange(4), mesh, [Partial("avg")])
    elif case == "from_local avg of ints":
        from_local(np.arange(4), mesh, [Partial("avg")])
    elif case == "redistribute to avg of ints":
        distribute_tensor(np.arange(4), mesh, [Replicate()]).redistribute(
            placements=[Partial("avg")]
        )
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case, ranks, message",
    [
        ("placements", [0, 1], "2 placements .* for a mesh of 1 dimensions"),
        ("dim", [0, 1], r"Shard\(2\) on mesh dimension 0: the tensor has 2 dimension"),
        ("from_local", [0, 1], "rank 0 has shape .* and rank 1 .*same size"),
        ("from_local ndim", [0, 1], "from_local: rank 0 has a 2-d piece, rank 1 a 3-d one"),
        ("from_local placements", [0, 1], r"rank 0 passes placements \[Shard\(1\)\], rank 1"),
        ("from_local refused", [0, 1], "2 placements .* for a mesh of 1 dimensions"),
        ("from_local shape", [0, 1], r"rank 0 passes shape=\(5, 2\) but the ranks' pieces make"),
        ("from_local device", [0, 1], "rank 0 holds a cuda array, rank 1 a cpu one"),
        ("two meshes", [0, 1], "mixes DTensors of two meshes"),
        ("not in mesh", [0, 1], "must hold every rank of the world 0..1"),
        ("mesh shape", [0, 1], r"mesh shape \(3,\) holds 3 ranks but the world has 2"),
        ("partial", [0, 1], "would change the reduced value; redistribute to Replicate"),
        ("slice by number", [0, 1], r"slice a DeviceMesh by dimension names .*mesh_dim_names="),
        ("shape below 1", [0, 1], r"mesh shape \(-2, -1\) has a dimension below 1"),
        ("ranks not integers", [0, 1], r"holds integer ranks, got \[0.9, 1.5\]"),
        ("device", [0, 1], "device_type must be 'cpu' or 'cuda', got 'gpu'"),
        ("names a string", [0, 1], r"got the string 'ab'; pass \('ab',\) for one"),
        ("complex partial", [0, 1], r"do not reduce complex128 \(Partial\('max'\) on mesh"),
        ("avg of ints", [0, 1], r"AVG needs a floating-point array, got int64; .*Partial\('avg'\)"),
        ("from_local avg of ints", [0, 1], r"AVG needs a floating-point array.*mesh dimension 0"),
        ("redistribute to avg of ints", [0, 1], "AVG needs a floating-point array, got int64"),
    ],
)
def test_bad_input_fails_on_every_rank_with_what_to_do(case, ranks, message, counting):
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_errors, 2, args=(case,))
    sent = [c for calls in counting.calls.values() for c in calls]
    if case.startswith("from_local"):  # the check itself: one exchange, then the error
        assert {c[0] for c in sent} == {"all_gather"}
    else:
        assert sent == [], "nothing may be sent before the error"
    assert sorted(e.rank for e in failed.value.errors) == ranks
    for e in failed.value.errors:
        typed = ("avg of ints", "by number", "not integers", "names a string", "complex partial")
        assert e.kind == ("TypeError" if case.endswith(typed) else "ValueError"), e
        assert f"rank {e.rank}:" in e.message
        import re

        assert re.search(message, e.message), e.message


def _pieces_of_their_own_body():
    rank = pb.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    whole = np.arange(12.0).reshape(3, 4)
    # a strided piece on one rank only (a transpose's): every collective still gets a
    # contiguous one, on every rank
    terms = whole.T.copy() * (rank + 1), (whole * (rank + 1)).T
    x = from_local(terms[rank], mesh, [Partial()])
    assert x.to_local().flags.c_contiguous
    np.testing.assert_array_equal(x.full_tensor(), 3 * whole.T)
    np.testing.assert_array_equal(x.T.full_tensor(), 3 * whole)
    # distribute_tensor copies: the caller's array is never written, nor read again
    kept = whole.copy()
    y = distribute_tensor(whole, mesh, [Partial("avg")])
    z = y.redistribute(placements=[Replicate()], donate=True)
    whole[:] = -1
    np.testing.assert_array_equal(z.to_local(), kept)
    np.testing.assert_array_equal(distribute_tensor(kept, mesh).full_tensor(), kept)
    # a read-only piece, donated: reduced in a copy
    frozen = kept * (rank + 1)
    frozen.flags.writeable = False
    total = from_local(frozen, mesh, [Partial()]).redistribute(
        placements=[Replicate()], donate=True
    )
    np.testing.assert_array_equal(total.to_local(), 3 * kept)
    # a redistribute with nothing to do is the DTensor itself; donated, both are gone
    r = distribute_tensor(kept, mesh, [Partial()])
    assert r.redistribute(placements=[Partial()]) is r
    term = r.to_local()
    again = r.redistribute(placements=[Partial()], donate=True)
    assert again.to_local() is term and "donated" in repr(r)
    with pytest.raises(ValueError, match="donate=True"):
        r.to_local()
    # Replicate -> Partial gives each rank a term of its own: donating it keeps the source
    s = distribute_tensor(kept, mesh)
    for op in ("sum", "avg", "max"):
        t = s.redistribute(placements=[Partial(op)]).redistribute(
            placements=[Replicate()], donate=True
        )
        np.testing.assert_array_equal(t.to_local(), kept)
        np.testing.assert_array_equal(s.to_local(), kept)
    # Replicate -> Shard cuts a piece of its own, even where the cut is contiguous (rows):
    # donating it leaves the source as it was
    rows = s.redistribute(placements=[Shard(0)])
    assert not np.shares_memory(rows.to_local(), s.to_local())
    rows.redistribute(placements=[Replicate()], donate=True)
    np.testing.assert_array_equal(s.to_local(), kept)
    # 0-d arrays keep their shape
    for placements in ([Replicate()], [Partial()], [Partial("max")]):
        point = distribute_tensor(np.array(3.5), mesh, placements)
        assert point.to_local().shape == () and point.full_tensor().shape == ()
        assert point.full_tensor() == 3.5
    pending = distribute_tensor(kept, mesh, [Shard(0)]).redistribute(
        placements=[Replicate()], async_op=True
    )
    assert "dtype=float64 (pending)" in repr(pending)
    np.testing.assert_array_equal(pending.to_local(), kept)
    return True


def test_every_piece_is_contiguous_and_its_own_and_donating_writes_nothing_else():
    assert run_ranks(_pieces_of_their_own_body, 2, timeout=40) == [True, True]


def _reductions_like_numpy_body():
    mesh = init_device_mesh("cpu", (2,))
    flags = np.array([True, True, False, True, True])
    small = np.full(4, 100, np.int8)
    for placements in ([Shard(0)], [Replicate()]):
        total = distribute_tensor(flags, mesh, placements).sum()
        assert total.full_tensor() == 4 and total.dtype == flags.sum().dtype
        assert distribute_tensor(small, mesh, placements).sum().full_tensor() == 400
    with pytest.raises(ValueError, match="max over an axis of size 0"):
        distribute_tensor(np.zeros((3, 0)), mesh, [Shard(0)]).max(axis=1)
    x = distribute_tensor(np.array([1.0, 2.0, 4.0]), mesh, [Shard(0)])
    np.testing.assert_array_equal((1 / x).full_tensor(), [1.0, 0.5, 0.25])
    # Partial max terms [1, -5, 0] and [0, -2, 3]: the value is [1, -2, 3]
    terms = [np.array([1.0, -5.0, 0.0]), np.array([0.0, -2.0, 3.0])][pb.get_rank()]
    peak = from_local(terms, mesh, [Partial("max")])
    for got, want, op in [
        (5 - peak, [4.0, 7.0, 2.0], "min"),
        (peak * -2, [-2.0, 4.0, -6.0], "min"),
        (2 * peak, [2.0, -4.0, 6.0], "max"),
        (peak / -1, [-1.0, 2.0, -3.0], "min"),
    ]:
        assert got.placements == (Partial(op),)
        np.testing.assert_array_equal(got.full_tensor(), want)
    return True


def test_reductions_and_scalar_operations_give_what_numpy_gives():
    assert run_ranks(_reductions_like_numpy_body, 2, timeout=40) == [True, True]


def _numpy_functions_body():
    mesh = init_device_mesh("cpu", (2,))
    whole = np.arange(-3.0, 7.0).reshape(5, 2)
    x = distribute_tensor(whole, mesh, [Shard(0)])
    for got, want in [
        (np.exp(x), np.exp(whole)),
        (np.float32(2) * x, 2 * whole),
        (x - np.float64(1), whole - 1),
        (np.sum(x), whole.sum()),
        (np.mean(x, axis=0), whole.mean(axis=0)),
        (np.max(x), whole.max()),
        (abs(x), abs(whole)),
        (x**2, whole**2),
        (np.power(x, 3), whole**3),
    ]:
        assert isinstance(got, DTensor)
        np.testing.assert_allclose(got.full_tensor(), want)
    with pytest.raises(TypeError, match="not one array on this rank; use x.full_tensor"):
        np.asarray(x)
    # a binary ufunc: elementwise on equal layouts or with a scalar
    for got, want in [
        (np.maximum(x, 0), np.maximum(whole, 0)),
        (np.maximum(x, x * 2), np.maximum(whole, whole * 2)),
        (np.greater(x, 0.5), whole > 0.5),
        (np.arctan2(1.0, x), np.arctan2(1.0, whole)),
    ]:
        assert isinstance(got, DTensor) and got.placements == (Shard(0),)
        np.testing.assert_array_equal(got.full_tensor(), want)
    cols = distribute_tensor(whole, mesh, [Shard(1)])
    with pytest.raises(
        ValueError, match=r"maximum of Shard\(0\) and Shard\(1\) on mesh dimension 0"
    ):
        np.maximum(x, cols)
    with pytest.raises(
        ValueError, match=r"maximum of Partial\(\) \(mesh dimension 0\) and a scalar would change"
    ):
        np.maximum(distribute_tensor(whole, mesh, [Partial()]), 0)
    with pytest.raises(TypeError, match="divmod on a DTensor has no placement rule"):
        np.divmod(x, 2)
    with pytest.raises(TypeError, match="add on a DTensor has no placement rule with out"):
        np.add(x, 1.0, out=np.empty(1))
    with pytest.raises(ValueError, match="sum of a DTensor takes no dtype="):
        np.sum(x, dtype=np.float32)

    # numpy's own type errors (no loop for those dtypes) say the rank and the operation; a
    # user's function raises what it raises
    class Unsupported(TypeError):
        pass

    def unsupported(local):
        raise Unsupported("no fast path here")

    with pytest.raises(Unsupported, match="^no fast path here$"):
        elementwise(unsupported, x)
    rank = pb.get_rank()
    for call, what in [
        (lambda: np.bitwise_and(x, x), "bitwise_and of float64 and float64"),
        (lambda: np.left_shift(x, 1), "left_shift of float64 and int"),
        (lambda: np.invert(x), "elementwise invert of float64"),
    ]:
        with pytest.raises(TypeError, match=rf"^rank {rank}: {what}: ufunc '\w+' not supported"):
            call()
    terms = [np.array([1.0, -5.0]), np.array([0.0, -2.0])][pb.get_rank()]
    peak = from_local(terms, mesh, [Partial("max")])
    assert np.negative(peak).placements == (Partial("min"),)
    np.testing.assert_array_equal(np.negative(peak).full_tensor(), [-1.0, 2.0])
    with pytest.raises(ValueError, match=r"elementwise exp of Partial\('max'\)"):
        np.exp(peak)
    return True


def test_numpy_functions_follow_the_placement_rules_or_refuse():
    assert run_ranks(_numpy_functions_body, 2, timeout=40) == [True, True]


def _scalars_on_partial_terms_body():
    """A Partial's terms with a scalar give the reduced value's result, or are refused where
    they would not: integers wrap (and an empty piece's max term is the dtype's smallest),
    bool sum terms are or-ed, and -inf * 0 is nan."""
    mesh = init_device_mesh("cpu", (4,))
    ints = np.array([[-2, -1], [-5, -7], [-3, -4]])  # 3 rows over 4 ranks: rank 3 holds none
    peak = np.max(distribute_tensor(ints, mesh, [Shard(0)]), axis=0)  # Partial("max")
    for make in (lambda: -peak, lambda: peak * 2, lambda: peak - 1):
        with pytest.raises(ValueError, match="wrap around"):
            make()
    np.testing.assert_array_equal((peak / -2).full_tensor(), ints.max(axis=0) / -2)
    floats = np.max(distribute_tensor(ints.astype(np.float64), mesh, [Shard(0)]), axis=0)
    np.testing.assert_array_equal((-floats).full_tensor(), -ints.max(axis=0))
    np.testing.assert_array_equal((floats * -2).full_tensor(), ints.max(axis=0) * -2)
    with pytest.raises(ValueError, match="not finite and nonzero"):
        floats * 0
    rank = pb.get_rank()
    flags = from_local(np.array([True, rank % 2 == 0]), mesh, [Partial()])  # or-ed
    with pytest.raises(ValueError, match="bool terms are or-ed"):
        flags * 2
    narrow = from_local(np.full(2, 100, np.int8), mesh, [Partial()])  # wraps in int8
    with pytest.raises(ValueError, match="int8 terms into float64"):
        narrow / 2
    wide = from_local(np.full(2, 100, np.int64), mesh, [Partial()])
    np.testing.assert_array_equal((wide / 2).full_tensor(), [200.0, 200.0])
    with pytest.raises(ValueError, match="complex scalar"):
        floats * 1j
    both = np.array([[True, False], [True, True], [False, False]])
    truth = distribute_tensor(both, mesh, [Shard(0)])
    np.testing.assert_array_equal(np.max(truth, axis=0).full_tensor(), both.max(axis=0))
    np.testing.assert_array_equal(truth.min(axis=0).full_tensor(), both.min(axis=0))
    with pytest.raises(ValueError, match="takes no initial="):
        np.max(truth, initial=False)
    return True


def test_scalars_on_partial_terms_give_the_reduced_values_result_or_refuse():
    assert run_ranks(_scalars_on_partial_terms_body, 4, timeout=40) == [True] * 4


class _Device0d:
    """A device library's 0-d array: no numpy array, but ``get()`` copies it to the host."""

    ndim = 0

    def __init__(self, value: float):
        self.value = value

    def get(self):
        return np.asarray(self.value, np.float32)


def _widened_terms_and_numpy_edges_body():
    """Where a Partial's terms would change dtype on their way into a DTensor operation, a
    reduction or a matmul (bool and narrow-int sums reduce in another arithmetic), or a zero
    term would turn nan: refused on every rank. And numpy's rules at the edges: unsigned sums,
    half-precision means, bfloat16 max, integer negative powers, numpy-integer and repeated
    axes, numpy bools, np.matmul."""
    import ml_dtypes

    mesh = init_device_mesh("cpu", (4,))
    rank = pb.get_rank()
    narrow = from_local(np.full((1, 2), 100, np.int8), mesh, [Partial()])  # value wraps in int8
    halves = distribute_tensor(np.full((1, 2), 0.5), mesh, [Replicate()])
    weights = distribute_tensor(np.ones((2, 2)), mesh, [Replicate()])
    wider = from_local(np.full((1, 2), 100, np.int16), mesh, [Partial()])
    for make, what in (
        (lambda: narrow * halves, "mul of Partial"),
        (lambda: narrow + wider, "add of Partial"),
        (lambda: narrow.sum(), "sum of Partial"),
        (lambda: narrow.mean(axis=0), "mean of Partial"),
        (lambda: narrow @ weights, "matmul of Partial"),
    ):
        with pytest.raises(ValueError, match=f"{what}.* int8 terms into "):
            make()
    rows = np.arange(6.0).reshape(3, 2)  # 3 rows over 4 ranks: rank 3's term is zero
    column_sums = distribute_tensor(rows, mesh, [Shard(0)]).sum(axis=0)
    for make in (lambda: column_sums * np.inf, lambda: column_sums / 0.0):
        with pytest.raises(ValueError, match="zero term nan where the value gives an infinity"):
            make()
    np.testing.assert_array_equal((column_sums / np.inf).full_tensor(), [0.0, 0.0])
    small = np.arange(12, dtype=np.uint8).reshape(4, 3)
    total = distribute_tensor(small, mesh, [Shard(0)]).sum()
    assert total.dtype == np.int64 and total.full_tensor() == small.sum()
    big = np.full((200, 1000), 1000, np.float16)  # a piece's float16 sum overflows
    mean = distribute_tensor(big, mesh, [Shard(0)]).mean()
    assert mean.dtype == np.float16 and mean.full_tensor() == big.mean() == 1000
    bf16 = np.array([[-1, 2], [3, -4], [5, 6]], ml_dtypes.bfloat16)
    peaks = distribute_tensor(bf16, mesh, [Shard(0)]).max(axis=0)
    np.testing.assert_array_equal((-peaks).full_tensor(), -bf16.max(axis=0))
    assert distribute_tensor(bf16, mesh, [Replicate()]).min().full_tensor() == -4
    ints = distribute_tensor(np.arange(1, 4).reshape(3, 1), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="int64 to the negative integer power -1"):
        ints**-1  # rank 3's piece is empty: numpy alone would not raise there
    split = distribute_tensor(rows, mesh, [Shard(0)])
    np.testing.assert_array_equal(split.sum(axis=np.int64(1)).full_tensor(), rows.sum(axis=1))
    with pytest.raises(ValueError, match=r"axis \(0, 0\) repeats an axis"):
        split.sum(axis=(0, 0))
    np.testing.assert_array_equal((split * np.True_).full_tensor(), rows)
    np.testing.assert_array_equal(np.matmul(split, weights).full_tensor(), rows @ np.ones((2, 2)))
    # a device library's 0-d array (a reduction's result) is a scalar, copied to the host
    np.testing.assert_array_equal((split / _Device0d(4.0)).full_tensor(), rows / 4)
    np.testing.assert_array_equal((split ** _Device0d(2.0)).full_tensor(), rows**2)
    return rank


def test_widened_partial_terms_are_refused_and_numpy_edges_follow_numpy():
    assert run_ranks(_widened_terms_and_numpy_edges_body, 4, timeout=40) == [0, 1, 2, 3]


def _copies_and_transposes_own_their_pieces_body():
    """A transpose's piece and a copy's are their own: donating either leaves the source as it
    was. A deep copy after an asynchronous redistribute (whose work holds locks) works, and
    placements that are not a sequence of placements get the same error as from_local's."""
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(np.arange(4.0), mesh, [Partial()])
    x.T.redistribute(placements=[Replicate()], donate=True)
    copy.copy(x).redistribute(placements=[Replicate()], donate=True)
    np.testing.assert_array_equal(x.full_tensor(), np.arange(4.0))
    pending = x.redistribute(placements=[Replicate()], async_op=True)
    twin = copy.deepcopy(pending)
    np.testing.assert_array_equal(twin.to_local(), np.arange(4.0))
    np.testing.assert_array_equal(copy.deepcopy(x).full_tensor(), np.arange(4.0))
    errors = []
    for bad in (Shard(0), [[Shard(0)]]):
        with pytest.raises(TypeError) as refused:
            x.redistribute(placements=bad)
        errors.append(str(refused.value))
    return errors


def test_copies_and_transposes_own_their_pieces():
    for rank, errors in enumerate(run_ranks(_copies_and_transposes_own_their_pieces_body, 2)):
        assert errors == [
            f"rank {rank}: placements Shard(0) must be a sequence, one per mesh dimension",
            f"rank {rank}: placement [Shard(0)] is not a Shard, Replicate or Partial",
        ]


def _mesh_of_an_ended_world_body():
    """A mesh made before destroy_process_group, used in the world started after it: refused,
    instead of making its group in the new world (cached under the old one, so that a new
    mesh would make the same rank set again)."""
    import pluribus.distributed as dist

    rank, store = pb.get_rank(), dist._world()["store"]
    old = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    old.get_group("tp")  # "dp" is not used in the first world
    pb.destroy_process_group()
    pb.init_process_group("threads", rank=rank, world_size=4, store=store, timeout=20)
    with pytest.raises(ValueError, match="made in a world that destroy_process_group ended"):
        old.get_group("dp")
    new = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = np.ones(1)
    pb.all_reduce(x, group=new.get_group("dp"))
    return float(x[0])


def test_a_mesh_of_an_ended_world_is_refused_in_the_next():
    assert run_ranks(_mesh_of_an_ended_world_body, 4, timeout=40) == [2.0] * 4


def _torch_spellings_body():
    """The keyword names and small methods a torch user types first."""
    rank = pb.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert mesh.get_group(mesh_dim="tp") is mesh.get_group(1)
    assert mesh.get_local_rank(mesh_dim="dp") == rank // 2 and mesh.size(mesh_dim=1) == 2
    assert mesh.get_coordinate() == [rank // 2, rank % 2] and mesh.get_rank() == rank
    x = distribute_tensor(np.arange(12.0).reshape(3, 4), mesh, [Shard(0), Replicate()])
    assert (x.dim(), x.numel(), len(x)) == (2, 12, 3)
    y = from_local(x.to_local(), mesh, [Shard(0), Replicate()], shape=(3, 4), stride=(4, 1))
    assert y.layout is x.layout
    scalar = distribute_tensor(np.array(2.0), mesh)
    assert from_local(scalar.to_local(), mesh, shape=(), stride=()).full_tensor() == 2.0
    with pytest.raises(ValueError, match=r"stride can only be \(4, 1\)"):
        from_local(x.to_local(), mesh, [Shard(0), Replicate()], shape=(3, 4), stride=(1, 3))
    np.testing.assert_array_equal(
        x.full_tensor(grad_placements=None), np.arange(12.0).reshape(3, 4)
    )
    with pytest.raises(ValueError, match="autograd hint"):
        x.full_tensor(grad_placements=[Replicate(), Replicate()])
    # plan keys match one dotted part at a time: "*" is each child, never the root
    model = nn.Sequential(nn.Linear(4, 6, rng=0), nn.Linear(6, 4, rng=1))
    parallelize_module(model, mesh["tp"], {"*": ColwiseParallel(use_local_output=True)})
    assert [p.data.shape for p in model.parameters()] == [(3, 4), (3,), (2, 6), (2,)]
    with pytest.raises(ValueError, match=r"use_local_output=False\): pluribus.nn layers"):
        ColwiseParallel(use_local_output=False)
    return True


def _from_a_source_rank_body():
    """src_data_rank=k: the array of the rank at mesh coordinate (k, k), whatever the others
    passed; the caller's array is left as it was."""
    rank = pb.get_rank()
    mesh = init_device_mesh("cpu", (2, 2))  # coordinate (k, k): rank 0 for k=0, rank 3 for k=1
    mine = np.arange(12.0).reshape(3, 4) + 100 * rank
    got = []
    for k in (0, 1):
        x = distribute_tensor(mine, mesh, [Shard(0), Shard(1)], src_data_rank=k)
        got.append(x.full_tensor())
    assert mine[0, 0] == 100 * rank
    with pytest.raises(ValueError, match="src_data_rank=2 must be an index of every mesh"):
        distribute_tensor(mine, mesh, src_data_rank=2)
    with pytest.raises(ValueError, match="src_data_rank=True must be an index"):
        distribute_tensor(mine, mesh, src_data_rank=True)
    numpy_k = distribute_tensor(mine, mesh, [Replicate(), Replicate()], src_data_rank=np.int64(1))
    got.append(numpy_k.to_local())
    return got


def test_distribute_tensor_from_a_source_rank():
    for first, last, numpy_k in run_ranks(_from_a_source_rank_body, 4, timeout=40):
        np.testing.assert_array_equal(first, np.arange(12.0).reshape(3, 4))
        np.testing.assert_array_equal(last, np.arange(12.0).reshape(3, 4) + 300)
        np.testing.assert_array_equal(numpy_k, last)


def test_torch_spellings_work():
    assert run_ranks(_torch_spellings_body, 4, timeout=40) == [True] * 4


def _donating_the_source_of_a_pending_redistribute_body():
    """A pending redistribute on one mesh dimension's group reads its source's piece in the
    background; donating the source to a redistribute on the other dimension's group (which
    nothing orders after the first) must wait for it, not write the piece under it."""
    mesh = init_device_mesh("cpu", (2, 2))
    reference = np.arange(1 << 20, dtype=np.float64) % 97
    waited = []
    for _ in range(8):
        x = distribute_tensor(reference, mesh, [Partial(), Partial()])
        y = x.redistribute(placements=[Replicate(), Partial()], async_op=True)
        work = y._pending[0]
        wait = work.wait
        work.wait = lambda *a, wait=wait, **k: waited.append(True) or wait(*a, **k)
        z = x.redistribute(placements=[Partial(), Replicate()], donate=True)
        assert waited, "the donation did not wait for the pending read of its piece"
        np.testing.assert_array_equal(y.full_tensor(), reference)
        np.testing.assert_array_equal(z.full_tensor(), reference)
        waited.clear()
    # a write in place (as checkpoint.load makes) through local_to_write waits the same way
    x = distribute_tensor(reference, mesh, [Partial(), Partial()])
    y = x.redistribute(placements=[Replicate(), Partial()], async_op=True)
    work = y._pending[0]
    wait = work.wait
    work.wait = lambda *a, wait=wait, **k: waited.append(True) or wait(*a, **k)
    x.local_to_write()[...] = -1
    assert waited, "local_to_write did not wait for the pending read of the piece"
    np.testing.assert_array_equal(y.full_tensor(), reference)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_donating_the_source_of_a_pending_redistribute_waits_for_it(backend):
    if backend == "gloo":
        pytest.importorskip("pluribus_gloo")
    body = _donating_the_source_of_a_pending_redistribute_body
    assert run_ranks(body, 4, backend=backend, timeout=100) == [True] * 4


def test_placements_and_layouts_are_interned_values():
    """Equal placements and layouts are one object (the plan cache hashes by identity), and
    stay so through copies and pickles; they cannot be changed in place."""
    import copy
    import pickle

    from pluribus.dtensor.layout import Layout

    assert Shard(0) is Shard(0) is Shard(np.int64(0)) is Shard(dim=0)
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1) and Shard(1) != Replicate()
    assert Partial() is Partial("sum") and Partial("max") is not Partial()
    assert Partial("avg").reduce_op is pb.ReduceOp.AVG and Replicate() is Replicate()
    assert isinstance(Replicate(), Replicate) and Replicate().is_replicate()
    with pytest.raises(TypeError):
        Replicate(0)
    for p in (Shard(3), Replicate(), Partial("min")):
        assert pickle.loads(pickle.dumps(p)) is p and copy.deepcopy(p) is p
        assert len({p, copy.copy(p)}) == 1
    with pytest.raises(AttributeError, match="immutable"):
        Shard(0).dim = 1
    for _ in range(2):  # a refused value is not remembered as a placement
        with pytest.raises(TypeError, match="dim must be an integer"):
            Shard(0.5)
    with pytest.raises(TypeError, match=r"Shard\(\) missing 1 required positional argument"):
        Shard()
    assert isinstance(Shard(7), Shard) and Shard(7).dim == 7 and Shard(7).is_shard(7)
    with pytest.raises(ValueError, match="Partial's reduce_op must be one of"):
        Partial("prod")
    with pytest.raises(ValueError, match="Partial's reduce_op must be one of"):
        Partial(pb.ReduceOp.PRODUCT)
    # torch's spellings: the keyword, the enum, is_partial(op)
    assert Partial(reduce_op="max") is Partial(pb.ReduceOp.MAX) is Partial("max")
    assert Partial().is_partial("sum") and not Partial().is_partial("avg")
    assert Partial("avg").is_partial() and not Shard(0).is_partial("sum")
    a = Layout((5, 2), (Shard(0),), ((3, 2),))
    b = Layout([5, np.int64(2)], [Shard(0)], [[3, 2]])
    assert a is b and a.shape == (5, 2) and a.sizes == ((3, 2),)
    assert a is not Layout((5, 2), (Shard(0),), ((2, 3),))
    assert pickle.loads(pickle.dumps(a)) is a
    with pytest.raises(AttributeError, match="immutable"):
        a.shape = (1,)
    match Shard(2):
        case Shard(dim=d):
            assert d == 2


def test_dtensor_is_exported_where_users_look():
    import pluribus.dtensor as dt

    assert dt.DTensor is DTensor and dt.init_device_mesh is init_device_mesh
    assert DTensor.from_local is from_local


def _uneven_on_a_real_backend():
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    reference = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)  # 5 rows over 3: 2, 2, 1
    x = distribute_tensor(reference, mesh, [Shard(0)])
    chain = [[Shard(1)], [Partial()], [Shard(0)], [Replicate()], [Partial("max")], [Shard(1)]]
    for target in chain:
        x = x.redistribute(placements=target)
        np.testing.assert_array_equal(x.full_tensor(), reference)
    rows = [3, 0, 2][pb.get_rank()]  # from_local with the ranks' own sizes, one of them empty
    start = [0, 3, 3][pb.get_rank()]
    y = DTensor.from_local(reference[start : start + rows], mesh, [Shard(0)])
    np.testing.assert_array_equal(y.redistribute(placements=[Shard(1)]).full_tensor(), reference)
    # large enough for gloo's reduce-scatter + all-gather rounds (chunks uneven over 3 ranks),
    # reduced out of place into the new array
    n = (1 << 20) // 4 + 1
    term = np.arange(n, dtype=np.float32) * (pb.get_rank() + 1)
    z = DTensor.from_local(term.copy(), mesh, [Partial()])
    assert z.redistribute_plan([Replicate()]).collectives == ["all_reduce_into"]
    total = z.redistribute(placements=[Replicate()])
    np.testing.assert_array_equal(total.to_local(), np.arange(n, dtype=np.float32) * 6)
    np.testing.assert_array_equal(z.to_local(), term)  # the source is left as it was
    return True


@pytest.mark.timeout(120)
def test_uneven_layouts_on_gloo_processes():
    pytest.importorskip("pluribus_gloo")
    assert run_ranks(_uneven_on_a_real_backend, 3, backend="gloo", timeout=100) == [True] * 3


def _astype_and_comparisons_body():
    mesh = init_device_mesh("cpu", (2,))
    rank = pb.get_rank()
    whole = np.arange(-3.0, 7.0).reshape(5, 2)
    x = distribute_tensor(whole, mesh, [Shard(0)])
    narrow = x.astype(np.float32)
    assert narrow.dtype == np.float32 and narrow.placements == (Shard(0),)
    assert not np.shares_memory(narrow.to_local(), x.to_local())
    np.testing.assert_array_equal(narrow.full_tensor(), whole.astype(np.float32))
    for got, want in [(x > 2, whole > 2), (x <= x * 2, whole <= whole * 2), (1 < x, 1 < whole)]:
        assert got.dtype == np.bool_ and got.placements == (Shard(0),)
        np.testing.assert_array_equal(got.full_tensor(), want)
    # Partial: casts that keep the reduced value, and those refused
    terms = np.array([1.5, -2.0]) * (rank + 1)
    summed = from_local(terms.astype(np.float32), mesh, [Partial()])
    np.testing.assert_array_equal(summed.astype(np.float64).full_tensor(), [4.5, -6.0])
    peak = from_local(terms, mesh, [Partial("max")])
    np.testing.assert_array_equal(peak.astype(np.float32).full_tensor(), [3.0, -2.0])
    errors = []
    for call in (
        lambda: from_local(np.array([100, 100], np.int8), mesh, [Partial()]).astype(np.int64),
        lambda: from_local(terms, mesh, [Partial()]).astype(np.float32),
        lambda: from_local(np.array([300, -1]), mesh, [Partial("max")]).astype(np.int8),
    ):
        with pytest.raises(ValueError) as refused:
            call()
        errors.append(str(refused.value))
    assert all(e.startswith(f"rank {rank}: astype of Partial") for e in errors), errors
    assert "narrow integers wrap" in errors[0]
    assert "from float64 to float32" in errors[1] and "redistribute to Replicate" in errors[1]
    assert "Partial('max') (mesh dimension 0) from int64 to int8" in errors[2]
    with pytest.raises(ValueError, match=f"rank {rank}: astype to complex128: the collectives"):
        x.astype(np.complex128)
    # a comparison's truth is ambiguous, as numpy's is: no `if x < 0` taken on len() alone
    with pytest.raises(ValueError, match=f"rank {rank}: the truth value of a DTensor"):
        bool(x < 0)
    with pytest.raises(ValueError, match="truth value"):
        max(distribute_tensor(np.array([5.0]), mesh, [Replicate()]), 0)
    return True


def test_astype_and_comparisons_follow_the_placement_rules():
    assert run_ranks(_astype_and_comparisons_body, 2, timeout=40) == [True, True]
