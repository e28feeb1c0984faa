"""Symmetric memory on gloo with real processes: ``pluribus.empty_symmetric`` gives arrays that
every rank has mapped, the in-place all-reduce on them runs without copying in (and gives the
copying path's answer bit for bit), ranks that disagree fall back together, bad input is
refused on every rank naming the ranks, and no segment is left in /dev/shm, also when a rank
dies. (The algorithm itself, with random sizes, offsets and disagreements, is checked in
test_gloo_arena.py.)"""

from __future__ import annotations

import contextlib
import gc
import glob
import os

import numpy as np
import pluribus as pb
import pytest
from pluribus.testing import RankPool, RanksFailed, run_ranks
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
    agreed: list[bool] = []
    original = local._announce_and_agree

    def counted(arena, data, found):
        peers = original(arena, data, found)
        agreed.append(peers is not None)
        return peers

    local._announce_and_agree = counted
    try:
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
    finally:
        local._announce_and_agree = original
    return agreed


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
    # 10 and 100_000 elements are one-shot (two copies within 1 MiB); the others are uneven
    # parts over two ranks, the largest several half-slots long
    got = pair.run(_parity, (10, 100_000, 300_001, 1_000_003))
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
    # 50_000 float32s at 4 ranks are one-shot
    got = run_ranks(_parity, 4, "gloo", "processes", timeout=90, args=((50_000, 600_001),))
    for report in got:
        assert report["zero_copy"] == [600_001, 600_001]


def _dies_while_mapping() -> None:
    if pb.get_rank() == 1:  # dies once rank 0 created the segment and named it
        symmetric.shm.open_mapping = lambda name, nbytes: os._exit(3)
    pb.empty_symmetric(1 << 20, np.float32)


@pytest.mark.timeout(60)
def test_a_rank_that_dies_leaves_no_segment_behind():
    """Rank 0 creates the segment and waits for rank 1, which died: it raises naming rank 1
    within seconds and unlinks the segment (the autouse fixture checks /dev/shm)."""
    with pytest.raises(RanksFailed) as info:
        run_ranks(_dies_while_mapping, 2, "gloo", "processes", timeout=30)
    errors = {e.rank: e for e in info.value.errors}
    assert errors[0].kind == "PeerError" and "rank 1" in errors[0].message, errors[0]


def _symmetric_against(other: str) -> None:
    """Rank 0 reduces a symmetric array; rank 1 runs ``other`` (or dies) instead."""
    x = pb.empty_symmetric(1 << 18, np.float32)
    x[...] = 1
    if pb.get_rank() == 0:
        pb.all_reduce(x)
    elif other == "dies":
        os._exit(3)
    else:
        pb.broadcast(x, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("other, kind", [("broadcast", "CollectiveMismatchError"), ("dies", "")])
def test_the_zero_copy_path_keeps_the_arenas_promises(other, kind):
    """A peer that calls another collective is a mismatch on every rank; a peer that dies is a
    PeerError naming it; both within seconds, not at the timeout (90 s)."""
    with pytest.raises(RanksFailed) as info:
        run_ranks(_symmetric_against, 2, "gloo", "processes", timeout=90, args=(other,))
    errors = {e.rank: e for e in info.value.errors}
    if kind:
        assert [errors[r].kind for r in (0, 1)] == [kind, kind], errors
        assert "all_reduce" in errors[0].message and "broadcast" in errors[0].message
    else:
        assert errors[0].kind == "PeerError" and "rank 1" in errors[0].message, errors[0]
