"""Basic indexing of DTensors: the global result is numpy's, nothing is sent, a slice of a
sharded dimension leaves each rank its part (the new sizes recorded), and exactly the indices
that would leave the result on one rank or in reverse mesh order are refused."""

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


@st.composite
def _indices(draw, shape):
    """A basic index of ``shape``: per dimension an integer or a slice of any bounds and step,
    maybe fewer than the dimensions, Nones put in, and an Ellipsis for a run of whole ones."""
    items = []
    for n in shape[: draw(st.integers(0, len(shape)))]:
        if n and draw(st.integers(0, 3)) == 0:
            items.append(draw(st.integers(-n, n - 1)))
        else:
            bound = st.none() | st.integers(-n - 2, n + 2)
            step = draw(st.sampled_from([None, 1, 2, 3, -1, -2]))
            items.append(slice(draw(bound), draw(bound), step))
    if draw(st.booleans()):
        k = draw(st.integers(0, len(items)))
        items[k:k] = [Ellipsis]
    for _ in range(draw(st.integers(0, 2))):
        items.insert(draw(st.integers(0, len(items))), None)
    return tuple(items) if len(items) != 1 or draw(st.booleans()) else items[0]


def _per_dimension(index, ndim):
    """The item that indexes each dimension (whole slices where the index says nothing)."""
    items = [i for i in (index if isinstance(index, tuple) else (index,)) if i is not None]
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items[k : k + 1] = [slice(None)] * (ndim - len(items) + 1)
    return items + [slice(None)] * (ndim - len(items))


def _indexed(mesh_shape, shape, placements, dtype, index, counting):
    mesh = init_device_mesh("cpu", mesh_shape)
    x = distribute_tensor(np.arange(math.prod(shape), dtype=dtype).reshape(shape), mesh, placements)
    mark = counting.mark(pb.get_rank())
    try:
        y = x[index]
    except (ValueError, IndexError) as e:
        return f"{type(e).__name__}: {e}", None, counting.since(pb.get_rank(), mark)
    sent = counting.since(pb.get_rank(), mark)
    local = y.to_local()
    own = not np.shares_memory(local, x.to_local()) and local.flags.c_contiguous
    return None, (y.full_tensor(), list(y.placements), y.layout.sizes, own), sent


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_indexing_is_numpys_and_refused_exactly_where_no_layout_holds_it(data):
    mesh, shape, placements, dtype = data.draw(layout_cases(largest=7, favour_shards=True))
    index = data.draw(_indices(shape))
    with counting_collectives("test-dtensor-indexing-counting") as counting:
        results = run_ranks(
            _indexed, math.prod(mesh), args=(mesh, shape, placements, dtype, index, counting)
        )
    assert all(sent == [] for *_, sent in results)
    errors = [error for error, _, _ in results]
    try:
        want = np.arange(math.prod(shape), dtype=dtype).reshape(shape)[index]
    except IndexError:  # an integer out of bounds (an Ellipsis moved it): numpy's error too
        event("out of bounds")
        assert all(e is not None and e.startswith("IndexError: rank ") for e in errors), errors
        return
    items = _per_dimension(index, len(shape))
    refusable = any(
        isinstance(p, Shard)
        and (not isinstance(items[p.dim], slice) or (items[p.dim].step or 1) < 0)
        for p in placements
    )
    if refusable:
        event("refused")
        assert all(e is not None and e.startswith("ValueError: rank ") for e in errors), errors
        assert all("redistribute mesh dimension" in e for e in errors), errors
        return
    event("indexed" + (" a sharded array" if any(isinstance(p, Shard) for p in placements) else ""))
    assert errors == [None] * len(results), errors
    for _, (whole, got, sizes, own), _ in results:
        np.testing.assert_array_equal(whole, want)
        assert own
        assert [type(p) for p in got] == [type(p) for p in placements]
        for m, p in enumerate(got):  # a shard's sizes add up to its dimension of the result
            if isinstance(p, Shard):
                assert sum(sizes[m]) == want.shape[p.dim]


def _named():
    mesh = init_device_mesh("cpu", (2,))
    whole = np.arange(30.0).reshape(5, 6)
    rows = distribute_tensor(whole, mesh, [Shard(0)])  # rows 0-2 and 3-4
    window = rows[1:4]
    strided = rows[None, ::2, 4]
    partial = distribute_tensor(whole, mesh, [Partial()])[2, 1:3]
    errors = errors_of(
        (
            lambda: rows[1],
            lambda: rows[::-1],
            lambda: rows[[0, 1]],
            lambda: rows[0:2, 0:2, 0],
            lambda: rows[..., ...],
            lambda: rows[:, 6],
        ),
        typed=True,
    )
    return (
        (window.layout.sizes, window.full_tensor()),
        (strided.placements, strided.layout.sizes, strided.full_tensor()),
        (partial.placements, partial.full_tensor()),
        errors,
    )


def test_named_indices():
    whole = np.arange(30.0).reshape(5, 6)
    for rank, (window, strided, partial, errors) in enumerate(run_ranks(_named, 2)):
        assert window[0] == ((2, 1),)  # rows 1-2 on rank 0, row 3 on rank 1
        np.testing.assert_array_equal(window[1], whole[1:4])
        assert strided[:2] == ((Shard(1),), ((2, 1),))
        np.testing.assert_array_equal(strided[2], whole[None, ::2, 4])
        assert partial[0] == (Partial(),)
        np.testing.assert_array_equal(partial[1], whole[2, 1:3])
        assert all(e.split(": ", 1)[1].startswith(f"rank {rank}: ") for e in errors), errors
        assert "ValueError" in errors[0] and "with the integer 1" in errors[0]
        assert "redistribute mesh dimension 0 to Replicate first" in errors[0]
        assert "ValueError" in errors[1] and "with a negative step" in errors[1]
        assert "TypeError" in errors[2] and "basic indices" in errors[2]
        assert "IndexError" in errors[3] and "too many indices for a 2-d DTensor" in errors[3]
        assert "IndexError" in errors[4] and "single ellipsis" in errors[4]
        assert "IndexError" in errors[5] and "index 6 is out of bounds for dimension 1" in errors[5]


def _odd():
    mesh = init_device_mesh("cpu", (2,))
    rows = distribute_tensor(np.arange(30.0).reshape(5, 6), mesh, [Shard(1)])
    scalar = distribute_tensor(np.float64(5.0), mesh)
    errors = errors_of(
        (
            lambda: rows[np.array([0, 1])],  # an array has __index__, but is an advanced index
            lambda: rows[np.array(True)],
            lambda: rows[::0],
            lambda: rows[0:1.5],
            lambda: list(scalar),
            lambda: 3.0 in rows,
        ),
        typed=True,
    )
    return errors, [r.full_tensor() for r in rows]


def test_arrays_zero_steps_and_iteration():
    whole = np.arange(30.0).reshape(5, 6)
    for rank, (errors, listed) in enumerate(run_ranks(_odd, 2)):
        assert all(
            e is not None and e.split(": ", 1)[1].startswith(f"rank {rank}: ") for e in errors
        ), errors
        assert errors[0].startswith("TypeError") and "basic indices" in errors[0]
        assert errors[1].startswith("TypeError") and "basic indices" in errors[1]
        assert errors[2].startswith("ValueError") and errors[3].startswith("TypeError")
        assert "iteration over a 0-d DTensor" in errors[4]
        assert len(listed) == 5 and all(
            np.array_equal(a, b) for a, b in zip(listed, whole, strict=True)
        )


# -- setitem ------------------------------------------------------------------------------------


def _assigned(mesh_shape, shape, placements, dtype, index, how, counting):
    """``x[index] = value`` with a scalar, a whole (broadcast) array, or the DTensor
    ``x[index] * 2``; the result and the error, if any."""
    mesh = init_device_mesh("cpu", mesh_shape)
    whole = np.arange(math.prod(shape), dtype=dtype).reshape(shape)
    x = distribute_tensor(whole, mesh, placements)
    try:
        selected = x[index]
    except (ValueError, IndexError):
        return "refused", None, []
    value = {  # only the one asked for is made: ``selected * 2`` is refused for some layouts
        "scalar": lambda: np.dtype(dtype).type(7),
        "whole": lambda: (
            np.arange(math.prod(selected.shape), dtype=dtype).reshape(selected.shape) + 100
        ),
        "dtensor": lambda: selected * 2,
    }[how]
    try:
        value = value()
    except ValueError:  # an integer Partial max/min times 2 may wrap: refused
        return "refused", None, []
    mark = counting.mark(pb.get_rank())
    x[index] = value
    sent = counting.since(pb.get_rank(), mark)
    return None, x.full_tensor(), sent


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_setitem_writes_what_numpy_writes_with_nothing_sent(data):
    mesh, shape, placements, dtype = data.draw(layout_cases(largest=6, favour_shards=True))
    index = data.draw(_indices(shape))
    how = data.draw(st.sampled_from(["scalar", "whole", "dtensor"]))
    with counting_collectives("test-dtensor-setitem-counting") as counting:
        results = run_ranks(
            _assigned,
            math.prod(mesh),
            args=(mesh, shape, placements, dtype, index, how, counting),
        )
    whole = np.arange(math.prod(shape), dtype=dtype).reshape(shape)
    if results[0][0] == "refused":  # an index getitem refuses: setitem takes the same ones
        return
    want = whole.copy()
    try:
        selected = whole[index]
    except IndexError:
        return
    want[index] = {
        "scalar": 7,
        "whole": np.arange(selected.size, dtype=dtype).reshape(selected.shape) + 100,
        "dtensor": selected * 2,
    }[how]
    event(how)
    for error, got, sent in results:
        assert error is None and sent == []
        np.testing.assert_array_equal(got, want)


def _bad_assignments():
    mesh = init_device_mesh("cpu", (2,))
    rows = distribute_tensor(np.arange(30.0).reshape(5, 6), mesh, [Shard(0)])
    before = rows.to_local().copy()
    other_layout = distribute_tensor(np.zeros((3, 6)), mesh, [Replicate()])
    errors = errors_of(
        (
            lambda: rows.__setitem__(slice(1, 4), other_layout),  # x[1:4] is rows split 2 + 1
            lambda: rows.__setitem__(slice(0, 2), np.zeros((3, 6))),
            lambda: rows.__setitem__(1, 0.0),
        )
    )
    return errors, np.array_equal(rows.to_local(), before)


def test_bad_assignments_are_refused_on_every_rank_and_write_nothing():
    for rank, (errors, unchanged) in enumerate(run_ranks(_bad_assignments, 2)):
        assert all(e is not None and e.startswith(f"rank {rank}: ") for e in errors), errors
        assert "setitem of a DTensor laid out as" in errors[0]
        assert "does not broadcast to the shape (2, 6) of x[slice(0, 2, None)]" in errors[1]
        assert "with the integer 1" in errors[2]
        assert unchanged


def _casts_checked_everywhere():
    mesh = init_device_mesh("cpu", (2,))
    small = distribute_tensor(np.arange(4, dtype=np.uint8), mesh, [Partial()])
    before = small.to_local().copy()
    ints = distribute_tensor(np.zeros(4, np.int64), mesh, [Partial()])
    halves = from_local(np.full(4, 0.5), mesh, [Partial()])
    errors = errors_of(
        (
            lambda: small.__setitem__(slice(0, 2), 300),  # rank 1 would write zeros
            lambda: ints.__setitem__(Ellipsis, halves),  # each term cast apart: 0 + 0, not 1
        )
    )
    return errors, np.array_equal(small.to_local(), before)


def test_a_value_the_dtype_cannot_take_is_refused_on_every_rank_before_any_writes():
    for rank, (errors, unchanged) in enumerate(run_ranks(_casts_checked_everywhere, 2)):
        assert all(e is not None and e.startswith(f"rank {rank}: ") for e in errors), errors
        assert "300" in errors[0] and unchanged
        assert "each term would be cast apart" in errors[1]
