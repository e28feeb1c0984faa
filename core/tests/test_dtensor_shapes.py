"""reshape (view) and permute of DTensors: the global result is numpy's, nothing is sent, and
a sharded reshape is refused exactly when no layout of the result holds the pieces as they
are (checked by brute force over every dimension of the result)."""

from __future__ import annotations

import math

import numpy as np
import pluribus as pb
import pytest
from dtensor_helpers import counting_collectives, errors_of, layout_cases
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pluribus.dtensor import Layout, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from pluribus.dtensor.layout import default_layout
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


@st.composite
def _new_shapes(draw, shape):
    """A shape of as many elements: neighbours merged or split, ones added or dropped, or the
    prime factors dealt out at random."""
    total = math.prod(shape)
    if total == 0:
        return (*draw(st.lists(st.integers(0, 4), max_size=2)), 0)
    way = draw(st.sampled_from(["merge", "split", "ones", "deal"]))
    dims = list(shape)
    if way == "merge" and len(dims) > 1:
        i = draw(st.integers(0, len(dims) - 2))
        dims[i : i + 2] = [dims[i] * dims[i + 1]]
    elif way == "split" and dims:
        i = draw(st.integers(0, len(dims) - 1))
        factors = [f for f in range(1, dims[i] + 1) if dims[i] % f == 0]
        f = draw(st.sampled_from(factors))
        dims[i : i + 1] = [f, dims[i] // f]
    elif way == "ones":
        dims = [n for n in dims if n != 1]
        for _ in range(draw(st.integers(0, 2))):
            dims.insert(draw(st.integers(0, len(dims))), 1)
    else:
        primes, n, p = [], total, 2
        while n > 1:
            while n % p == 0:
                primes.append(p)
                n //= p
            p += 1
        bins = draw(st.integers(1, 4)) if primes else draw(st.integers(0, 2))
        dims = [1] * bins
        for q in primes:
            dims[draw(st.integers(0, bins - 1))] *= q
    if draw(st.booleans()) and dims:  # numpy's -1
        dims[draw(st.integers(0, len(dims) - 1))] = -1
    return tuple(dims)


def _expressible(old_layout: Layout, mesh_shape, new_shape) -> bool:
    """Whether some layout of ``new_shape`` gives every rank the elements it holds now: per
    sharded mesh dimension, some dimension of the result and sizes along it that select the
    same row-major indices on every index of that mesh dimension."""
    total = math.prod(new_shape)
    flat = np.arange(total)
    old = np.unravel_index(flat, old_layout.shape)
    for m, p in enumerate(old_layout.placements):
        if not isinstance(p, Shard):
            continue
        held = old_layout.sizes[m]
        starts = np.cumsum((0, *held))
        mine = [(old[p.dim] >= starts[k]) & (old[p.dim] < starts[k + 1]) for k in range(len(held))]
        found = False
        for e, length in enumerate(new_shape):
            new = np.unravel_index(flat, new_shape)[e]
            counts = [int(s.sum()) * length // total if total else 0 for s in mine]
            bounds = np.cumsum((0, *counts))
            if bounds[-1] == length and all(
                np.array_equal(s, (new >= bounds[k]) & (new < bounds[k + 1]))
                for k, s in enumerate(mine)
            ):
                found = True
                break
        if not found:
            return False
    return True


def _reshaped(mesh_shape, shape, placements, dtype, new_shape, counting):
    mesh = init_device_mesh("cpu", mesh_shape)
    whole = np.arange(math.prod(shape), dtype=dtype).reshape(shape)
    x = distribute_tensor(whole, mesh, placements)
    mark = counting.mark(pb.get_rank())
    try:
        y = x.reshape(new_shape)
    except ValueError as e:
        return x.layout, str(e), None, counting.since(pb.get_rank(), mark)
    sent = counting.since(pb.get_rank(), mark)
    local = y.to_local()
    own = not np.shares_memory(local, x.to_local()) and local.flags.c_contiguous
    return x.layout, None, (y.full_tensor(), list(y.placements), own), sent


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_reshape_is_numpys_and_refused_only_where_no_layout_holds_the_pieces(data):
    mesh, shape, placements, dtype = data.draw(layout_cases(largest=8, favour_shards=True))
    new_shape = data.draw(_new_shapes(shape))
    with counting_collectives("test-dtensor-shapes-counting") as counting:
        results = run_ranks(
            _reshaped,
            math.prod(mesh),
            args=(mesh, shape, placements, dtype, new_shape, counting),
        )
    want = np.arange(math.prod(shape), dtype=dtype).reshape(shape).reshape(new_shape)
    errors = {error is None for _, error, _, _ in results}
    assert len(errors) == 1, results  # every rank decides alike
    layout, error, made, sent = results[0]
    assert all(s == [] for *_, s in results)
    sharded = any(isinstance(p, Shard) for p in placements)
    event(f"{'refused' if error else 'reshaped'}{' with a shard' if sharded else ''}")
    if error is None:
        for _, _, (whole, got_placements, own), _ in results:
            np.testing.assert_array_equal(whole, want)
            assert own
            assert [type(p) for p in got_placements] == [type(p) for p in placements]
            assert [p for p in got_placements if not isinstance(p, Shard)] == [
                p for p in placements if not isinstance(p, Shard)
            ]
    else:
        assert error.startswith("rank 0: reshape") and "redistribute mesh dimension" in error
        empty_with_shard = want.size == 0 and any(isinstance(p, Shard) for p in placements)
        # a shard held whole by one rank could move anywhere; the rule asks for a redistribute
        degenerate = any(
            isinstance(p, Shard) and max(layout.sizes[m]) == shape[p.dim]
            for m, p in enumerate(placements)
        )
        if not (empty_with_shard or degenerate):
            assert not _expressible(layout, mesh, want.shape), (error, new_shape)
            event("refused: no layout of the result holds the pieces")


def _named_cases():
    mesh = init_device_mesh("cpu", (2,))
    whole = np.arange(24.0).reshape(4, 6)
    rows = distribute_tensor(whole, mesh, [Shard(0)])
    cols = distribute_tensor(whole, mesh, [Shard(1)])
    split = rows.view(2, 2, 3, 2)  # rows (2 + 2) become blocks of the first new dimension
    merged = rows.reshape(-1)
    heads = distribute_tensor(np.arange(48.0).reshape(2, 24), mesh, [Shard(1)]).reshape(2, 4, 6)
    permuted = distribute_tensor(np.arange(24.0).reshape(2, 3, 4), mesh, [Shard(2)]).permute(
        2, 0, 1
    )
    partial = distribute_tensor(whole, mesh, [Partial()]).reshape(6, 4)
    through_numpy = np.reshape(rows, (2, 12))  # numpy calls x.reshape(shape, order="C")
    errors = errors_of(
        (
            lambda: cols.reshape(24),  # columns 0-2 of every row: not a block of 24
            lambda: rows.reshape(5, 5),
            lambda: rows.reshape(-1, -1),
            lambda: rows.reshape(2.5, 2),
            lambda: rows.permute(0, 0),
            lambda: rows.permute(0, 2),
            lambda: rows.reshape(24, order="F"),
        )
    )
    return (
        (split.placements, split.layout.sizes, split.full_tensor()),
        (merged.placements, merged.layout.sizes),
        (heads.placements, heads.layout.sizes, heads.full_tensor()),
        (permuted.placements, permuted.full_tensor()),
        (partial.placements, partial.full_tensor()),
        (through_numpy.placements, through_numpy.layout.sizes),
        rows.T.placements,
        errors,
    )


def test_named_reshapes_and_permutes():
    for rank, result in enumerate(run_ranks(_named_cases, 2)):
        split, merged, heads, permuted, partial, through_numpy, transposed, errors = result
        assert split[:2] == ((Shard(0),), ((1, 1),))
        np.testing.assert_array_equal(split[2], np.arange(24.0).reshape(2, 2, 3, 2))
        assert merged == ((Shard(0),), ((12, 12),))
        # the hidden dimension of 24 split into 4 heads of 6: the shard moves to the heads
        assert heads[:2] == ((Shard(1),), ((2, 2),))
        np.testing.assert_array_equal(heads[2], np.arange(48.0).reshape(2, 4, 6))
        assert permuted[0] == (Shard(0),)
        np.testing.assert_array_equal(
            permuted[1], np.arange(24.0).reshape(2, 3, 4).transpose(2, 0, 1)
        )
        assert partial[0] == (Partial(),)
        np.testing.assert_array_equal(partial[1], np.arange(24.0).reshape(6, 4))
        assert through_numpy == ((Shard(0),), ((1, 1),))
        assert transposed == (Shard(1),)
        assert all(e.startswith(f"rank {rank}: ") for e in errors), errors
        assert "reshape (4, 6) -> (24,) of Shard(1) on mesh dimension 0" in errors[0]
        assert "redistribute mesh dimension 0 to Replicate first" in errors[0]
        assert "cannot reshape a DTensor of shape (4, 6) into (5, 5)" in errors[1]
        assert "at most one of them -1" in errors[2] and "at most one of them -1" in errors[3]
        assert "permute of a 2-d DTensor takes each of its dimensions once" in errors[4]
        assert "permute of a 2-d DTensor" in errors[5]
        assert "reshapes in order 'C' only, got 'F'" in errors[6]


def test_replicated_reshapes_of_any_shape_pass_through():
    def reshaped():
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(np.arange(12.0), mesh, [Replicate()])
        return x.reshape(3, 1, 4).placements, x.reshape(3, 1, 4).to_local()

    for placements, local in run_ranks(reshaped, 2):
        assert placements == (Replicate(),)
        np.testing.assert_array_equal(local, np.arange(12.0).reshape(3, 1, 4))


def _transposed(mesh_shape, shape, placements, dtype, order, pair, counting):
    mesh = init_device_mesh("cpu", mesh_shape)
    x = distribute_tensor(np.arange(math.prod(shape), dtype=dtype).reshape(shape), mesh, placements)
    mark = counting.mark(pb.get_rank())
    made = [np.transpose(x), np.transpose(x, order), x.transpose(order), x.T]
    if pair is not None:
        made += [np.swapaxes(x, *pair), np.moveaxis(x, *pair)]
    sent = counting.since(pb.get_rank(), mark)
    return [(y.full_tensor(), y.placements) for y in made], sent


class _Order:
    """What ``np.moveaxis`` asks of an array: the order it hands ``transpose``."""

    def __init__(self, ndim):
        self.ndim = ndim

    def transpose(self, order):
        return tuple(order)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_transpose_swapaxes_and_moveaxis_are_numpys_and_send_nothing(data):
    mesh, shape, placements, dtype = data.draw(layout_cases(favour_shards=True))
    n = len(shape)
    order = tuple(data.draw(st.permutations(range(n))))
    pair = (data.draw(st.integers(-n, n - 1)), data.draw(st.integers(-n, n - 1))) if n else None
    with counting_collectives("test-dtensor-transpose-counting") as counting:
        results = run_ranks(
            _transposed,
            math.prod(mesh),
            args=(mesh, shape, placements, dtype, order, pair, counting),
        )
    whole = np.arange(math.prod(shape), dtype=dtype).reshape(shape)
    reverse = tuple(reversed(range(n)))
    orders = [reverse, order, order, reverse]
    if pair is not None:
        swapped = list(range(n))
        i, j = pair[0] % n, pair[1] % n
        swapped[i], swapped[j] = swapped[j], swapped[i]
        orders += [tuple(swapped), np.moveaxis(_Order(n), *pair)]
    for made, sent in results:
        assert sent == []
        assert len(made) == len(orders)
        for (got, got_placements), axes in zip(made, orders, strict=True):
            np.testing.assert_array_equal(got, np.transpose(whole, axes))
            # a shard follows its dimension to its new place
            assert list(got_placements) == [
                Shard(axes.index(p.dim)) if isinstance(p, Shard) else p for p in placements
            ]


def _ambiguous_transposes():
    mesh = init_device_mesh("cpu", (2,))
    square = distribute_tensor(np.arange(6.0).reshape(2, 3), mesh, [Shard(0)])
    cube = distribute_tensor(np.arange(24.0).reshape(2, 3, 4), mesh, [Shard(2)])
    swapped = square.transpose(1, 0)  # torch's swap and numpy's order agree
    same = square.transpose((0, 1))  # a tuple is numpy's spelling only
    back = np.transpose(cube, np.argsort([2, 0, 1]))  # axes as an array, as numpy takes them
    return (
        (swapped.placements, swapped.full_tensor()),
        (same.placements, same.full_tensor()),
        (back.placements, back.full_tensor()),
        errors_of(
            (
                lambda: square.transpose(0, 1),
                lambda: square.transpose(-2, -1),
                lambda: cube.transpose(0, 2),
                lambda: cube.swapaxes(0, 3),
                lambda: cube.transpose(0, 1, 1),
                lambda: cube.transpose(0, 5),
            )
        ),
    )


def test_a_transpose_numpy_and_torch_read_differently_is_refused():
    for rank, (swapped, same, back, errors) in enumerate(run_ranks(_ambiguous_transposes, 2)):
        assert swapped[0] == (Shard(1),)
        np.testing.assert_array_equal(swapped[1], np.arange(6.0).reshape(2, 3).T)
        assert same[0] == (Shard(0),)
        np.testing.assert_array_equal(same[1], np.arange(6.0).reshape(2, 3))
        assert back[0] == (Shard(1),)
        np.testing.assert_array_equal(
            back[1], np.arange(24.0).reshape(2, 3, 4).transpose(np.argsort([2, 0, 1]))
        )
        assert all(e.startswith(f"rank {rank}: ") for e in errors), errors
        assert "transpose(0, 1) of a 2-d DTensor is no change to numpy and a swap" in errors[0]
        assert "say which: x.transpose((0, 1)) or x.swapaxes(0, 1)" in errors[0]
        assert "x.transpose((-2, -1)) or x.swapaxes(-2, -1)" in errors[1]
        assert "numpy's transpose takes all 3 dimensions" in errors[2]
        assert "torch's transpose(0, 2) is x.swapaxes(0, 2)" in errors[2]
        assert "swapaxes of a 3-d DTensor takes two of its dimensions, got (0, 3)" in errors[3]
        assert "transpose of a 3-d DTensor takes each of its dimensions once" in errors[4]
        assert (
            "transpose of a 3-d DTensor takes each of its dimensions once, got (0, 5)"
            in (errors[5])
        )


def _shape_methods(mesh_shape, shape, placements, dtype, calls, counting):
    """Each named call's result (whole array, placements) or its refusal, and what was sent."""
    mesh = init_device_mesh("cpu", mesh_shape)
    x = distribute_tensor(np.arange(math.prod(shape), dtype=dtype).reshape(shape), mesh, placements)
    mark = counting.mark(pb.get_rank())
    made = []
    for name, args in calls:
        try:
            made.append(np.squeeze(x, *args) if name == "np.squeeze" else getattr(x, name)(*args))
        except ValueError as error:
            made.append(str(error))
    sent = counting.since(pb.get_rank(), mark)
    return [
        ("refused", y)
        if isinstance(y, str)
        else ("made", y.full_tensor(), y.placements, y is not x and not _shared(y, x))
        for y in made
    ], sent


def _shared(y, x) -> bool:
    return np.shares_memory(y.to_local(), x.to_local())


def _numpy_shape_method(whole, name, args):
    if name in ("flatten",) and args:  # torch's flatten(start_dim, end_dim)
        n = whole.ndim
        start, end = args[0] % n, args[1] % n
        merged = math.prod(whole.shape[start : end + 1])
        return whole.reshape(*whole.shape[:start], merged, *whole.shape[end + 1 :])
    if name == "unsqueeze":
        return np.expand_dims(whole, args[0])
    if name in ("copy", "clone", "contiguous"):
        return whole.copy()
    return np.squeeze(whole, *args) if name == "np.squeeze" else getattr(whole, name)(*args)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_flatten_squeeze_unsqueeze_and_copies_are_numpys_and_send_nothing(data):
    mesh, shape, placements, dtype = data.draw(
        layout_cases(favour_shards=True).filter(lambda case: len(case[1]) > 0)
    )
    n = len(shape)
    start, end = sorted(data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2)))
    ones = tuple(d for d, size in enumerate(shape) if size == 1)
    calls = [
        ("flatten", ()),
        ("ravel", ()),
        ("flatten", (start - n * data.draw(st.booleans()), end)),
        ("squeeze", ()),
        ("np.squeeze", (ones[:1] or None,)),
        ("unsqueeze", (data.draw(st.integers(-n - 1, n)),)),
        ("copy", ()),
        ("clone", ()),
        ("contiguous", ()),
    ]
    with counting_collectives("test-dtensor-shape-methods-counting") as counting:
        results = run_ranks(
            _shape_methods, math.prod(mesh), args=(mesh, shape, placements, dtype, calls, counting)
        )
    whole = np.arange(math.prod(shape), dtype=dtype).reshape(shape)
    for made, sent in results:
        assert sent == []
        for (name, args), got in zip(calls, made, strict=True):
            assert got[0] == results[0][0][calls.index((name, args))][0]  # every rank alike
            if got[0] == "refused":  # only a shard whose pieces no layout of the result holds
                assert name in ("flatten", "ravel", "squeeze", "np.squeeze"), got
                assert "redistribute mesh dimension" in got[1], got
                assert any(isinstance(p, Shard) for p in placements)
                event(f"{name} refused")
                if name in ("flatten", "ravel"):
                    new_shape = _numpy_shape_method(whole, name, args).shape
                    old = default_layout(shape, tuple(placements), mesh)
                    held_whole = any(  # a shard one rank holds whole could move anywhere
                        isinstance(p, Shard) and max(old.sizes[m]) == shape[p.dim]
                        for m, p in enumerate(placements)
                    )
                    first, last = (args[0] % n, args[1] % n) if args else (0, n - 1)
                    merged = [p for p in placements if isinstance(p, Shard)]
                    merged = [p for p in merged if first <= p.dim % n <= last]
                    # a dimension is sharded by one mesh dimension only
                    assert len(merged) > 1 or held_whole or not _expressible(old, mesh, new_shape)
                continue
            _, full, got_placements, owned = got
            want = _numpy_shape_method(whole, name, args)
            np.testing.assert_array_equal(full, want)
            assert full.shape == want.shape
            assert owned == (name != "contiguous")  # contiguous hands back x itself
            assert [type(p) for p in got_placements] == [type(p) for p in placements]


def _shape_method_refusals():
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(np.arange(24.0).reshape(4, 1, 6), mesh, [Shard(0)])
    return errors_of(
        (
            lambda: x.squeeze(0),
            lambda: x.flatten(2, 1),
            lambda: x.flatten("F"),
            lambda: x.unsqueeze(5),
            lambda: x.squeeze(3),
            lambda: distribute_tensor(np.zeros((1, 4)), mesh, [Shard(0)]).squeeze(),
            lambda: x.flatten((1, 2)),
            lambda: x.flatten(0, None),
            lambda: distribute_tensor(np.zeros(()), mesh, [Replicate()]).flatten(5, 7),
            lambda: x.flatten(order="F"),
        )
    )


def _edge_shapes():
    mesh = init_device_mesh("cpu", (2,))
    scalar = distribute_tensor(np.float64(3.0), mesh, [Replicate()])
    empty = distribute_tensor(np.zeros((4, 0, 3)), mesh, [Shard(0)])
    rows = distribute_tensor(np.arange(24.0).reshape(4, 6), mesh, [Shard(0)])
    made = {
        "scalar squeeze(0)": scalar.squeeze(0),
        "scalar squeeze(-1)": scalar.squeeze(-1),
        "scalar flatten": scalar.flatten(),
        "empty flatten(1, 2)": empty.flatten(1, 2),
        "empty flatten": empty.flatten(),
        "rows flatten(order=C)": rows.flatten(order="C"),
    }
    return {k: (y.shape, y.placements, y.layout.sizes, y.full_tensor()) for k, y in made.items()}


def test_shape_methods_at_the_edges_are_numpys():
    for made in run_ranks(_edge_shapes, 2):
        assert made["scalar squeeze(0)"][:2] == ((), (Replicate(),))
        assert made["scalar squeeze(-1)"][0] == ()
        assert made["scalar flatten"][0] == (1,)
        np.testing.assert_array_equal(made["scalar flatten"][3], [3.0])
        # a zero-size array: the shard outside the merged range stays; inside, all pieces empty
        assert made["empty flatten(1, 2)"][:3] == ((4, 0), (Shard(0),), ((2, 2),))
        assert made["empty flatten"][:3] == ((0,), (Shard(0),), ((0, 0),))
        assert made["rows flatten(order=C)"][:3] == ((24,), (Shard(0),), ((12, 12),))
        np.testing.assert_array_equal(made["rows flatten(order=C)"][3], np.arange(24.0))


def test_shape_methods_refuse_what_numpy_and_torch_refuse():
    for rank, errors in enumerate(run_ranks(_shape_method_refusals, 2)):
        assert all(e.startswith(f"rank {rank}: ") for e in errors), errors
        assert "squeeze of dimension 0 of a DTensor of shape (4, 1, 6)" in errors[0]
        assert "only a dimension of size one" in errors[0]
        assert "flatten of a 3-d DTensor from dimension 2 to 1: start after end" in errors[1]
        assert "flattens in order 'C' only, got 'F'" in errors[2]
        assert "unsqueeze of a 3-d DTensor takes a dimension in [-4, 3], got 5" in errors[3]
        assert "axis 3 does not exist in a 3-d DTensor" in errors[4]
        assert "squeeze of dimension 0, which mesh dimension 0 shards" in errors[5]
        assert "redistribute mesh dimension 0 to Replicate first" in errors[5]
        assert "flatten of a 3-d DTensor takes dimensions in [-3, 2], got (1, 2)" in errors[6]
        assert "got None" in errors[7]
        assert "flatten of a 0-d DTensor takes dimensions in [-1, 0], got 5" in errors[8]
        assert "flattens in order 'C' only, got 'F'" in errors[9]


def _two_shards_merged():
    mesh = init_device_mesh("cpu", (2, 2))
    x = distribute_tensor(np.arange(16.0).reshape(4, 4), mesh, [Shard(0), Shard(1)])
    row = distribute_tensor(np.arange(4.0).reshape(1, 4), mesh, [Shard(1), Shard(0)])
    return errors_of((lambda: x.flatten(), lambda: row.flatten()))


def test_flatten_refuses_two_mesh_dimensions_sharding_the_merged_dimension():
    for rank, errors in enumerate(run_ranks(_two_shards_merged, 4)):
        assert all(e.startswith(f"rank {rank}: ") for e in errors), errors
        assert "flatten (4, 4) -> (16,) of Shard(1) on mesh dimension 1" in errors[0]
        assert "mesh dimension 0 shards the merged dimension already" in errors[0]
        assert "flatten (1, 4) -> (4,) of Shard(0) on mesh dimension 1" in errors[1]
