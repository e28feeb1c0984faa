"""Symmetric memory on gloo: ``pluribus.empty_symmetric`` gives arrays that every rank has mapped,
the in-place all-reduce on them runs without copying in (and gives the copying path's answer
bit for bit), broadcast runs zero-copy exactly inside its window, sub-groups (also disjoint ones
at once) get their own allocations, ranks that disagree or pass another group's array fall back
together, bad input is refused on every rank naming the ranks, the group's store does not grow
with the number of allocations, and no segment is left in /dev/shm. (The algorithm itself, with
random sizes, offsets and disagreements, is checked in test_gloo_arena.py; failures in
test_gloo_symmetric_faults.py.)"""

from __future__ import annotations

import contextlib
import gc
import glob
import os

import numpy as np
import pluribus as pb
import pytest
from pluribus.testing import RankPool, run_ranks
from pluribus_gloo import local, symmetric


@contextlib.contextmanager
def _zero_copy_runs():
    """Note the size of every zero-copy all-reduce this rank runs inside the block."""
    runs: list[int] = []
    original = local._all_reduce_symmetric

    def counted(arena, arrays, ufunc):
        runs.append(arrays[arena.rank].size)
        original(arena, arrays, ufunc)

    local._all_reduce_symmetric = counted
    try:
        yield runs
    finally:
        local._all_reduce_symmetric = original


@contextlib.contextmanager
def _agreements():
    """Note, for every zero-copy decision this rank takes inside the block (each collective on
    the arena that announced where its input lies), whether every rank agreed: True means the
    collective ran zero-copy."""
    agreed: list[bool] = []
    original = local._announce_and_agree

    def counted(arena, data, found):
        peers = original(arena, data, found)
        agreed.append(peers is not None)
        return peers

    local._announce_and_agree = counted
    try:
        yield agreed
    finally:
        local._announce_and_agree = original


def _inputs(n: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((size, n)).astype(np.float32)


def _in_rank_order(inputs: np.ndarray) -> np.ndarray:
    total = inputs[0].copy()
    for row in inputs[1:]:
        total += row
    return total


def _parity(sizes: tuple[int, ...]) -> dict:
    """Every size in place on a symmetric array, then on a slice of a larger one at an odd
    offset, and AVG: the rank-order sum bit for bit; and which ran zero-copy."""
    rank, size = pb.get_rank(), pb.get_world_size()
    creator_segments = f"/dev/shm/plrb-{os.getpid()}-*"
    with _zero_copy_runs() as runs:
        for n in sizes:
            inputs = _inputs(n, size, n)
            x = pb.empty_symmetric(n, np.float32)
            assert isinstance(x, np.ndarray) and x.shape == (n,) and x.dtype == np.float32
            if rank == 0:
                assert not glob.glob(creator_segments), "unlinked once every rank mapped it"
            x[...] = inputs[rank]
            pb.all_reduce(x)
            np.testing.assert_array_equal(x, _in_rank_order(inputs))
            bigger = pb.empty_symmetric((n + 40,), np.float32)
            bigger[...] = -1
            view = bigger[13 : 13 + n]
            view[...] = inputs[rank]
            pb.all_reduce(view, pb.ReduceOp.AVG)
            np.testing.assert_allclose(view, inputs.mean(axis=0), rtol=1e-5, atol=1e-6)
            assert (bigger[:13] == -1).all() and (bigger[13 + n :] == -1).all()
        del x, bigger, view
        gc.collect()
    return {"zero_copy": runs, "live": len(symmetric._table[0])}


def _disagreements() -> tuple[list[int], list[int]]:
    """Ranks that pass plain arrays, other offsets, or arrays of another group's allocation:
    the answer is still right, and nothing ran zero-copy; a sub-group's own allocation runs
    zero-copy on it."""
    rank, size = pb.get_rank(), pb.get_world_size()
    n = 300_001
    inputs = _inputs(n, size, 7)
    expected = _in_rank_order(inputs)
    shared = pb.empty_symmetric(n + 8, np.float32)
    sub = pb.new_group(list(range(size)))  # the same ranks, another group's arena
    with _zero_copy_runs() as runs:
        for case in ("rank 0 plain", "offsets differ", "another group"):
            if case == "rank 0 plain" and rank == 0:
                x = np.empty(n, np.float32)
            else:
                at = rank if case == "offsets differ" else 0
                x = shared[at : at + n]
            x[...] = inputs[rank]
            pb.all_reduce(x, group=sub if case == "another group" else None)
            np.testing.assert_array_equal(x, expected, err_msg=case)
    with _zero_copy_runs() as on_sub:  # the sub-group's own allocation is symmetric on it
        x = pb.empty_symmetric(n, np.float32, group=sub)
        x[...] = inputs[rank]
        pb.all_reduce(x, group=sub)
        np.testing.assert_array_equal(x, expected)
    pb.destroy_process_group(sub)
    return runs, on_sub


def _gather_scatter_broadcast() -> list[bool]:
    """Broadcast, all-gather and reduce-scatter through the public API on symmetric inputs
    (into plain outputs) and on plain ones: numpy's answer either way; which ran zero-copy."""
    rank, size = pb.get_rank(), pb.get_world_size()
    n = 300_001
    inputs = _inputs(n, size, 11)
    with _agreements() as agreed:
        for symmetric_input in (True, False):
            x = pb.empty_symmetric(n, np.float32) if symmetric_input else np.empty(n, np.float32)
            x[...] = inputs[rank]
            pb.broadcast(x, src=1)
            np.testing.assert_array_equal(x, inputs[1])
            x[...] = inputs[rank]
            outs = [np.empty(n, np.float32) for _ in range(size)]
            pb.all_gather(outs, x)
            np.testing.assert_array_equal(np.stack(outs), inputs)
            out = np.empty(n // size, np.float32)
            whole = x[: out.size * size]
            pb.reduce_scatter(out, [whole[q * out.size : (q + 1) * out.size] for q in range(size)])
            lo = rank * out.size
            expected = inputs[rank, lo : lo + out.size].copy()
            for j in range(size):
                if j != rank:
                    expected += inputs[j, lo : lo + out.size]
            np.testing.assert_array_equal(out, expected)
    return agreed


def _broadcast_around_the_window(floor: int, cap: int) -> list[str]:
    """Broadcasts of symmetric arrays just below, at and just above both ends of the zero-copy
    window (``floor`` .. ``cap`` bytes, set small here): numpy's answer each time, and which
    path each took."""
    rank, size = pb.get_rank(), pb.get_world_size()
    window = local.ZERO_COPY_BYTES, local.BROADCAST_ZERO_COPY_MAX_BYTES
    local.ZERO_COPY_BYTES, local.BROADCAST_ZERO_COPY_MAX_BYTES = floor, cap
    paths = []
    try:
        for nbytes in (floor - 4, floor, cap - 4, cap, cap + 4):
            n = nbytes // 4
            inputs = _inputs(n, size, n)
            x = pb.empty_symmetric(n, np.float32)
            x[...] = inputs[rank]
            with _agreements() as agreed:
                pb.broadcast(x, src=1)
            np.testing.assert_array_equal(x, inputs[1], err_msg=f"{nbytes} bytes")
            paths.append("zero-copy" if agreed == [True] else f"copying {agreed}")
    finally:
        local.ZERO_COPY_BYTES, local.BROADCAST_ZERO_COPY_MAX_BYTES = window
    return paths


def _sub_groups() -> dict:
    """Ranks {1, 2} of 4, then the pairs {0, 1} and {2, 3} at once, allocate on their group
    and all-reduce and all-gather zero-copy on it; then arrays of one group used on another
    (the world's on a pair, a pair's on the world, two pairs' on {1, 2}): the copying path,
    and numpy's answer every time."""
    rank = pb.get_rank()
    n = 300_001
    inputs = _inputs(n, 4, 5)
    middle = pb.new_group([1, 2])
    pairs = [pb.new_group([0, 1]), pb.new_group([2, 3])]
    pair = pairs[rank // 2]
    mates = [2 * (rank // 2), 2 * (rank // 2) + 1]

    def reduce_and_gather(x, group, members):
        x[...] = inputs[rank]
        outs = [np.empty(n, np.float32) for _ in members]
        pb.all_gather(outs, x, group=group)
        np.testing.assert_array_equal(np.stack(outs), inputs[members])
        pb.all_reduce(x, group=group)
        np.testing.assert_array_equal(x, _in_rank_order(inputs[members]))

    with _agreements() as on_own_group:
        if rank in (1, 2):
            reduce_and_gather(pb.empty_symmetric(n, np.float32, group=middle), middle, [1, 2])
        mine = pb.empty_symmetric(n, np.float32, group=pair)
        reduce_and_gather(mine, pair, mates)
    world = pb.empty_symmetric(n, np.float32)
    with _agreements() as elsewhere:
        reduce_and_gather(world, pair, mates)
        reduce_and_gather(mine, None, [0, 1, 2, 3])
        if rank in (1, 2):
            reduce_and_gather(mine, middle, [1, 2])
    for group in (middle, *pairs):
        pb.destroy_process_group(group)
    return {"own group": on_own_group, "another group": elsewhere}


def _allocations_grow_the_store(k: int) -> int:
    """How many keys ``k`` allocations (after a first one) add to the group's store."""
    store = pb.get_default_group().store
    arena = pb.get_default_group().backends["cpu"].arena
    pb.empty_symmetric(10, np.float32)
    pb.barrier()
    before = store.num_keys()
    pb.barrier()  # nobody allocates before every rank counted
    for i in range(k):
        x = pb.empty_symmetric(1000 + i, np.float32)
        assert symmetric.locate(x, arena) is not None, "not a symmetric allocation"
    pb.barrier()
    return store.num_keys() - before


def _unequal_shapes() -> str:
    rank = pb.get_rank()
    with pytest.raises(ValueError) as info:
        pb.empty_symmetric((10 + rank, 2))
    pb.barrier()  # the group still works
    return str(info.value)


@pytest.fixture(scope="module")
def pair():
    with RankPool(2, "gloo", "processes", timeout=90) as pool:
        yield pool


@pytest.mark.timeout(120)
def test_symmetric_all_reduce_on_two_ranks(pair):
    # 10 elements and the largest array whose peer's copy fits the one-shot bound reduce in
    # one phase; the others are uneven parts over two ranks, the largest several half-slots long
    largest_one_shot = local.ONE_SHOT_BYTES // 4
    got = pair.run(_parity, (10, largest_one_shot, 300_001, 1_000_003))
    for report in got:
        assert report["zero_copy"] == [300_001, 300_001, 1_000_003, 1_000_003]
        assert report["live"] == 0, "the mappings went with the arrays"


@pytest.mark.timeout(120)
def test_symmetric_gather_scatter_broadcast_run_zero_copy(pair):
    assert pair.run(_gather_scatter_broadcast) == [[True] * 3 + [False] * 3] * 2


@pytest.mark.timeout(120)
def test_ranks_that_disagree_fall_back_together(pair):
    assert pair.run(_disagreements) == [([], [300_001]), ([], [300_001])]


@pytest.mark.timeout(120)
def test_unequal_shapes_are_refused_on_every_rank_naming_the_ranks(pair):
    for message in pair.run(_unequal_shapes):
        assert "rank 0: (10, 2) float32" in message and "rank 1: (11, 2) float32" in message
        assert "nothing was allocated" in message


@pytest.mark.timeout(120)
def test_symmetric_all_reduce_on_four_ranks():
    # the three peers' copies of this many float32s fit the one-shot bound, crowded or not
    one_shot = local.ONE_SHOT_BYTES // (4 * 3)
    got = run_ranks(_parity, 4, "gloo", "processes", timeout=90, args=((one_shot, 600_001),))
    for report in got:
        assert report["zero_copy"] == [600_001, 600_001]


@pytest.mark.timeout(120)
def test_broadcast_runs_zero_copy_exactly_inside_its_window(pair):
    """The cap (``BROADCAST_ZERO_COPY_MAX_BYTES``) and the floor (``ZERO_COPY_BYTES``) are
    inclusive; just outside either, the copying path gives the same answer."""
    expected = ["copying []", "zero-copy", "zero-copy", "zero-copy", "copying []"]
    assert pair.run(_broadcast_around_the_window, 16 << 10, 64 << 10) == [expected] * 2


@pytest.mark.timeout(120)
def test_sub_groups_allocate_and_run_zero_copy_on_their_own_arrays_only():
    got = run_ranks(_sub_groups, 4, "gloo", "processes", timeout=90)
    for rank, report in enumerate(got):
        assert report["own group"] == [True] * (4 if rank in (1, 2) else 2), (rank, report)
        assert not any(report["another group"]), (rank, report)


@pytest.mark.timeout(60)
def test_allocations_do_not_grow_the_store():
    """The group's store (a HashStore shared by thread ranks, so that it can be counted) holds
    no more keys after 20 allocations than before them."""
    assert run_ranks(_allocations_grow_the_store, 2, "gloo", "threads", args=(20,)) == [0, 0]
