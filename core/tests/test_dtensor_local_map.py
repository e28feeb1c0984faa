"""local_map: a function for local arrays run on DTensors' pieces, its results DTensors with
the placements the caller states (uneven sizes from the ranks), bad calls refused on every
rank before the function runs."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from dtensor_helpers import counting_collectives, errors_of
from pluribus.dtensor import (
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
    local_map,
)
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


WHOLE = np.random.default_rng(0).normal(size=(5, 4))


def _mapped():
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    rows = distribute_tensor(WHOLE, mesh, [Shard(0)])
    softmax = local_map(_softmax, [Shard(0)], [[Shard(0)]])
    y = softmax(rows)
    # a second result that is no array, and a keyword argument passed through
    with_note = local_map(
        lambda x, *, scale: (x * scale, "scaled"), ([Shard(0)], None), [[Shard(0)]]
    )
    scaled, note = with_note(rows, scale=2.0)
    # a replicated argument cut to the rows in_placements names
    replicated = distribute_tensor(WHOLE, mesh, [Replicate()])
    cut = local_map(_softmax, [Shard(0)], [[Shard(0)]], redistribute_inputs=True)(replicated)
    plain = softmax(WHOLE)  # no DTensor: the function's result as it is
    return (
        y.full_tensor(),
        y.layout.sizes,
        scaled.full_tensor(),
        note,
        cut.full_tensor(),
        type(plain).__name__,
    )


@pytest.mark.parametrize("world", [2, 3])
def test_a_softmax_over_split_rows_equals_numpy_with_the_ranks_sizes(world):
    for y, sizes, scaled, note, cut, plain in run_ranks(_mapped, world):
        np.testing.assert_allclose(y, _softmax(WHOLE), rtol=1e-12)
        assert sizes == (tuple(len(r) for r in np.array_split(WHOLE, world)),)
        np.testing.assert_array_equal(scaled, WHOLE * 2)
        assert note == "scaled"
        np.testing.assert_allclose(cut, _softmax(WHOLE), rtol=1e-12)
        assert plain == "ndarray"


def _refused():
    mesh = init_device_mesh("cpu", (2,))
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rows = distribute_tensor(WHOLE, mesh, [Shard(0)])
    ran = []

    def func(*args):
        ran.append(True)
        return args[0]

    errors = errors_of(
        (
            lambda: local_map(func, [Shard(0)], [[Replicate()]])(rows),
            lambda: local_map(func, [Shard(0)], [[Shard(0)], [Shard(0)]])(rows),
            lambda: local_map(func, [Shard(0)], [[Shard(0)], [Shard(0)]])(rows, "text"),
            lambda: local_map(func, [Shard(0)])(rows, distribute_tensor(WHOLE, other, [Shard(0)])),
            lambda: local_map(func, Shard(0)),
            lambda: local_map(lambda x: (func(x),) * 3, ([Shard(0)], None))(rows),
        )
    )
    return errors, len(ran)


def test_bad_calls_are_refused_by_name_on_every_rank():
    for rank, (errors, ran) in enumerate(run_ranks(_refused, 2)):
        assert all(e is not None and e.startswith(f"rank {rank}: ") for e in errors), errors
        assert (
            "argument 0 has placements [Shard(0)], in_placements names [Replicate()]" in errors[0]
        )
        assert "in_placements for 2 positional arguments and called with 1" in errors[1]
        assert "argument 1 is a str, not the DTensor with placements [Shard(0)]" in errors[2]
        assert "every DTensor argument is on one mesh" in errors[3]
        assert "give a sequence with one placement per mesh dimension" in errors[4]
        assert "gave 3 results, out_placements names 2" in errors[5]
        assert ran == 1  # only the last call got as far as the function


def _even_without_check(counting):
    mesh = init_device_mesh("cpu", (2,))
    rows = distribute_tensor(WHOLE[:4], mesh, [Shard(0)])  # 2 + 2 rows
    mark = counting.mark(pb.get_rank())
    unchecked = local_map(_softmax, [Shard(0)], run_check=False)(rows)
    sent_unchecked = counting.since(pb.get_rank(), mark)
    mark = counting.mark(pb.get_rank())
    checked = local_map(_softmax, [Shard(0)])(rows)
    sent_checked = counting.since(pb.get_rank(), mark)
    same = unchecked.layout == checked.layout
    return same, unchecked.full_tensor(), sent_unchecked, len(sent_checked)


def test_without_run_check_even_pieces_make_the_same_layout_with_nothing_sent():
    with counting_collectives("test-local-map-counting") as counting:
        results = run_ranks(_even_without_check, 2, args=(counting,))
    for same, whole, sent_unchecked, checked in results:
        assert same and sent_unchecked == [] and checked > 0
        np.testing.assert_allclose(whole, _softmax(WHOLE[:4]), rtol=1e-12)


def _results_checked():
    """One array where two results are named is refused (not split into its rows); ranks that
    give different numbers of results all raise (none waits in from_local); a result that is
    the argument's own piece is copied, so the two DTensors do not share it."""
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(np.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    n = 2 + pb.get_rank()
    errors = errors_of(
        (
            lambda: local_map(lambda a: a * 1, ([Shard(0)], [Shard(0)]), [[Shard(0)]])(x),
            lambda: local_map(lambda a: (a,) * n, ([Shard(0)], [Shard(0)]), [[Shard(0)]])(x),
        )
    )
    same = local_map(lambda a: a, [Shard(0)], [[Shard(0)]])(x)
    shares = np.shares_memory(same.to_local(), x.to_local())
    one = local_map(lambda a: a * 3, ([Shard(0)],), [[Shard(0)]])(x)  # torch's one-entry tuple
    return errors, shares, one.full_tensor()


def test_results_are_checked_on_every_rank_and_own_their_pieces():
    for rank, (errors, shares, one) in enumerate(run_ranks(_results_checked, 2)):
        assert all(e is not None and e.startswith(f"rank {rank}: ") for e in errors), errors
        assert "gave one ndarray, out_placements names 2 results" in errors[0]
        assert "gave 3 results, out_placements names 2" in errors[1]
        assert not shares
        np.testing.assert_array_equal(one, np.arange(8.0).reshape(4, 2) * 3)
