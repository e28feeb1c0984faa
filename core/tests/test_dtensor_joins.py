"""numpy's concatenate, stack and expand_dims of DTensors (``__array_function__``): the global
result is numpy's, nothing is sent, and a join along a sharded dimension is refused on every
rank; numpy's other functions behave as they did without the protocol."""

from __future__ import annotations

import math

import numpy as np
import pluribus as pb
import pytest
from dtensor_helpers import counting_collectives, errors_of, layout_cases
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pluribus.dtensor import (
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    from_local,
    init_device_mesh,
)
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def _arange(shape, dtype, offset):
    return (np.arange(math.prod(shape)) + offset).astype(dtype).reshape(shape)


def _joined(mesh_shape, shapes, placements, dtype, how, axis, counting):
    mesh = init_device_mesh("cpu", mesh_shape)
    xs = [
        distribute_tensor(_arange(s, dtype, 100 * k), mesh, placements)
        for k, s in enumerate(shapes)
    ]
    mark = counting.mark(pb.get_rank())
    try:
        if how == "concatenate":
            y = np.concatenate(xs, axis=axis)
        elif how == "stack":
            y = np.stack(xs, axis=axis)
        else:
            y = np.expand_dims(xs[0], axis)
    except ValueError as error:
        return "refused", str(error), counting.since(pb.get_rank(), mark)
    sent = counting.since(pb.get_rank(), mark)
    return "made", (y.full_tensor(), y.placements), sent


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_concatenate_stack_and_expand_dims_are_numpys_and_send_nothing(data):
    mesh, shape, placements, dtype = data.draw(
        layout_cases(favour_shards=True).filter(lambda case: len(case[1]) > 0)
    )
    n = len(shape)
    how = data.draw(st.sampled_from(["concatenate", "stack", "expand_dims"]))
    count = data.draw(st.integers(1, 3))
    shapes = [shape] * count
    if how == "concatenate":
        axis = data.draw(st.integers(-n, n - 1))
        shapes = [shape] + [
            tuple(
                data.draw(st.integers(0, 4)) if d == axis % n else size
                for d, size in enumerate(shape)
            )
            for _ in range(count - 1)
        ]
    elif how == "stack":
        axis = data.draw(st.integers(-n - 1, n))
    else:
        places = data.draw(st.lists(st.integers(0, n + 1), min_size=1, max_size=2, unique=True))
        out = n + len(places)
        axis = tuple(p - out * data.draw(st.booleans()) for p in places if p < out)
        axis = axis[0] if len(axis) == 1 and data.draw(st.booleans()) else axis
    with counting_collectives("test-dtensor-joins-counting") as counting:
        results = run_ranks(
            _joined, math.prod(mesh), args=(mesh, shapes, placements, dtype, how, axis, counting)
        )
    wholes = [_arange(s, dtype, 100 * k) for k, s in enumerate(shapes)]
    sharded_axis = how == "concatenate" and Shard(axis % n) in placements
    for status, result, sent in results:
        assert sent == []
        if sharded_axis:
            assert status == "refused", result
            assert "which mesh dimension" in result and "redistribute mesh dimension" in result
            event("refused: the axis is sharded")
            continue
        assert status == "made", result
        got, got_placements = result
        if how == "concatenate":
            want = np.concatenate(wholes, axis=axis)
            shifted = list(placements)
        elif how == "stack":
            want, at = np.stack(wholes, axis=axis), axis % (n + 1)
            shifted = [
                Shard(p.dim + (p.dim >= at)) if isinstance(p, Shard) else p for p in placements
            ]
        else:
            want = np.expand_dims(wholes[0], axis)
            # where each old dimension went: the new array's dimensions not of the given axes
            new = [
                d for d in range(want.ndim) if d not in {a % want.ndim for a in np.atleast_1d(axis)}
            ]
            shifted = [Shard(new[p.dim]) if isinstance(p, Shard) else p for p in placements]
        np.testing.assert_array_equal(got, want)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert list(got_placements) == shifted
        event(how)


def _refusals():
    mesh = init_device_mesh("cpu", (2,))
    rows = distribute_tensor(np.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    whole = distribute_tensor(np.arange(12.0).reshape(4, 3), mesh, [Replicate()])
    terms = from_local(np.full((4, 3), pb.get_rank() + 1.0), mesh, [Partial()])  # sums to 3
    narrow = distribute_tensor(np.ones((4, 3), np.float32), mesh, [Partial()])
    rank = pb.get_rank()
    errors = errors_of(
        (
            lambda: np.concatenate([rows, rows]),  # along the sharded rows
            lambda: np.concatenate([rows, whole], axis=1),
            lambda: np.concatenate([rows, np.zeros((4, 3))], axis=1),
            lambda: np.concatenate([terms, narrow], axis=1),
            lambda: np.concatenate([rows, rows], axis=1, dtype=np.float32),
            lambda: np.concatenate([distribute_tensor(np.float64(1), mesh, [Replicate()])] * 2),
            lambda: np.stack([rows, rows], axis=3),
            lambda: np.stack([rows, distribute_tensor(np.ones((5, 3)), mesh, [Shard(0)])]),
            lambda: np.expand_dims(rows, (0, 0)),
            lambda: np.expand_dims(rows, 3),
            lambda: np.concatenate([rows, rows], axis=None),
            lambda: np.concatenate([rows, rows], axis=(1, 0)),
            lambda: np.concatenate([rows, rows], axis=True),
        )
    )
    typed = []
    for call in (
        lambda: np.asarray([1, 2], like=rows),  # numpy's own refusal of like=
        lambda: np.resize(rows, (2, 2)),
        lambda: np.vecdot(rows, rows),  # a generalized ufunc: core dimensions change the shape
    ):
        try:
            call()
            typed.append(None)
        except TypeError as error:
            typed.append(str(error))
    # numpy's defaults spelled out, and the orders that mean "C" for a C-ordered piece
    spelled = [
        np.concatenate([rows, rows], axis=1, casting="same_kind").shape,
        np.stack([rows, rows], dtype=None).shape,
        np.ravel(rows, order="K").shape,
    ]
    kept = np.expand_dims(rows, ())
    own = kept is not rows and not np.shares_memory(kept.to_local(), rows.to_local())
    # numpy's other functions: methods where numpy calls them, the refusal elsewhere
    summed = np.sum(rows).full_tensor()
    moved = np.moveaxis(rows, 0, 1).placements
    try:
        np.where(rows)
        where = None
    except TypeError as error:
        where = str(error)
    same_terms = np.concatenate([terms, terms], axis=0).full_tensor()
    return rank, errors, typed, spelled, own, summed, moved, where, same_terms


def test_joins_refuse_before_anything_is_sent_and_other_functions_are_unchanged():
    for rank, errors, typed, spelled, own, summed, moved, where, same_terms in run_ranks(
        _refusals, 2
    ):
        assert all(e.startswith(f"rank {rank}: ") for e in errors), errors
        assert "concatenate along dimension 0, which mesh dimension 0 shards" in errors[0]
        assert "placements [Shard(0)] (2-d) and [Replicate()] (2-d, array 1)" in errors[1]
        assert "concatenate takes a non-empty sequence of DTensors" in errors[2]
        assert "Partial terms of float64 and float32 (array 1)" in errors[3]
        assert "takes no out=, dtype= or casting=" in errors[4]
        assert "concatenate of 0-d DTensors" in errors[5]
        assert "stack of 2-d DTensors takes an axis in [-3, 2], got 3" in errors[6]
        assert "shapes (4, 3) and (5, 3) (array 1): they differ in dimension 0" in errors[7]
        assert "repeats an axis" in errors[8]
        assert "axis 3 is not in [-3, 2]" in errors[9]
        assert "concatenate along dimension 0, which mesh dimension 0 shards" in errors[10]
        assert "takes an axis in [-2, 1], got (1, 0)" in errors[11]
        assert "takes an axis in [-2, 1], got True" in errors[12]
        assert "no implementation found for 'numpy.asarray'" in typed[0]
        assert typed[1].startswith(f"rank {rank}: np.resize of a DTensor has no rule")
        assert typed[2].startswith(f"rank {rank}: numpy's vecdot on a DTensor has no placement")
        assert spelled == [(4, 6), (2, 4, 3), (12,)]
        assert own
        assert summed == 66.0
        assert moved == (Shard(1),)
        assert where is not None and "not one array on this rank" in where
        # Partial terms join term by term: the sum of the joined terms is the joined sums
        np.testing.assert_array_equal(same_terms, np.full((8, 3), 3.0))
