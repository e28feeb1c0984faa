"""rand and randn: the same global array from the same seed on any mesh and placements, equal
to the documented Philox stream drawn on one process; each rank draws only its own piece."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from dtensor_helpers import counting_collectives, errors_of, layout_cases
from hypothesis import given, settings
from pluribus.dtensor import Partial, Shard, init_device_mesh, rand, randn, random
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def _reference(shape, seed, dtype, normal):
    """The whole array on one process, from the stream as the module documents it."""
    n = int(np.prod(shape))
    raw = np.random.Philox(key=seed).random_raw(2 * n if normal else n)
    if not normal:
        bits = np.finfo(dtype).nmant + 1
        values = (raw >> np.uint64(64 - bits)).astype(np.float64) / 2.0**bits
    else:
        u1 = ((raw[0::2] >> np.uint64(11)).astype(np.float64) + 1) / 2.0**53
        u2 = (raw[1::2] >> np.uint64(11)).astype(np.float64) / 2.0**53
        values = np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)
    return values.astype(dtype).reshape(shape)


def _piece_and_where(dtensor):
    """This rank's piece, the slices of the whole array it holds, and whether it is a zero term
    of a Partial("sum") (the value lives on the first rank of that mesh dimension)."""
    mesh = dtensor.device_mesh
    zero = any(
        isinstance(p, Partial) and p.op == "sum" and mesh.coordinate[m] != 0
        for m, p in enumerate(dtensor.placements)
    )
    return dtensor.to_local(), dtensor.layout.local_slices(mesh.coordinate), zero


def _drawn(mesh_shape, shape, placements, dtype, seed, counting):
    mesh = init_device_mesh("cpu", mesh_shape)
    mark = counting.mark(pb.get_rank())
    made = {
        "rand": rand(*shape, device_mesh=mesh, placements=placements, dtype=dtype, seed=seed),
        "randn": randn(shape, device_mesh=mesh, placements=placements, dtype=dtype, seed=seed),
    }
    sent = counting.since(pb.get_rank(), mark)
    return {name: (d.dtype, d.placements, _piece_and_where(d)) for name, d in made.items()}, sent


@settings(max_examples=25, deadline=None)
@given(layout_cases(dtypes=("float16", "float32", "float64"), largest=6))
def test_every_layout_holds_the_same_array_as_one_process_draws(case):
    mesh, shape, placements, dtype = case
    seed = 2**64 + 12345  # a key wider than one word
    with counting_collectives("test-dtensor-random-counting") as counting:
        results = run_ranks(
            _drawn, int(np.prod(mesh)), args=(mesh, shape, placements, dtype, seed, counting)
        )
    for made, sent in results:
        assert sent == [], case
        for name, (got_dtype, got_placements, (piece, where, zero)) in made.items():
            want = _reference(shape, seed, np.dtype(dtype), name == "randn")
            assert got_dtype == np.dtype(dtype) and list(got_placements) == placements
            # every rank's piece is exactly its box of the one array (a sum's other terms 0)
            expected = np.zeros_like(want[where]) if zero else want[where]
            np.testing.assert_array_equal(piece, expected, err_msg=f"{name} {case}")


@pytest.mark.parametrize("jump_cost", [0, 256, 10**9])
@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_a_box_is_drawn_alike_by_spans_or_jumps_and_in_any_chunks(monkeypatch, jump_cost, chunk):
    """Whatever mix of long spans and jumps the cost model picks, and however the outputs are
    chunked, each box holds the one array's values."""
    monkeypatch.setattr(random, "JUMP_COST", jump_cost)
    monkeypatch.setattr(random, "CHUNK", chunk)
    shape = (3, 4, 5)
    for normal in (False, True):
        want = _reference(shape, 11, np.dtype(np.float32), normal)
        for offsets, sizes in [
            ((0, 0, 0), (3, 4, 5)),
            ((1, 0, 0), (2, 4, 5)),
            ((0, 1, 0), (3, 2, 5)),
            ((0, 0, 2), (3, 4, 3)),
            ((1, 2, 1), (2, 1, 3)),
            ((2, 3, 4), (1, 1, 1)),
            ((0, 0, 0), (3, 0, 5)),
        ]:
            got = random.piece(11, shape, offsets, sizes, np.dtype(np.float32), normal)
            box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
            np.testing.assert_array_equal(got, want[box], err_msg=f"{offsets} {sizes}")
    scalar = random.piece(11, (), (), (), np.dtype(np.float64), False)
    np.testing.assert_array_equal(scalar, _reference((), 11, np.dtype(np.float64), False))


def test_few_columns_of_many_rows_are_drawn_in_few_spans(monkeypatch):
    """A Shard(1) piece of a tall array: spans over several rows, not one jump per row."""
    jumps = []
    draw = random._outputs
    monkeypatch.setattr(random, "_outputs", lambda *args: jumps.append(args[2]) or draw(*args))
    got = random.piece(5, (20000, 4), (0, 2), (20000, 2), np.dtype(np.float64), False)
    np.testing.assert_array_equal(
        got, _reference((20000, 4), 5, np.dtype(np.float64), False)[:, 2:]
    )
    assert len(jumps) <= 2


def test_bfloat16_is_drawn_exactly_in_its_bits():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    got = random.piece(3, (1000,), (0,), (1000,), np.dtype(ml_dtypes.bfloat16), False)
    raw = np.random.Philox(key=3).random_raw(1000)
    np.testing.assert_array_equal(got.astype(np.float64), (raw >> np.uint64(56)) / 2.0**8)


def _statistics():
    mesh = init_device_mesh("cpu", (2,))
    u = rand(400, 500, device_mesh=mesh, placements=[Shard(1)], dtype=np.float64, seed=3)
    z = randn(400, 500, device_mesh=mesh, placements=[Shard(0)], dtype=np.float32, seed=3)
    u, z = u.full_tensor(), z.full_tensor()
    return float(u.min()), float(u.max()), float(u.mean()), float(z.mean()), float(z.std())


def test_values_are_uniform_and_standard_normal():
    lo, hi, mean, z_mean, z_std = run_ranks(_statistics, 2)[0]
    assert 0.0 <= lo < 1e-4 and 1 - 1e-4 < hi < 1.0
    assert abs(mean - 0.5) < 0.005  # 200 000 values: the mean's deviation is about 0.0006
    assert abs(z_mean) < 0.01 and abs(z_std - 1) < 0.01


def _no_seed():
    mesh = init_device_mesh("cpu", (2,))
    a = rand(6, device_mesh=mesh, placements=[Shard(0)])
    b = rand(6, device_mesh=mesh, placements=[Shard(0)])
    return a.full_tensor(), b.full_tensor()


def test_without_a_seed_the_ranks_agree_and_each_call_draws_anew():
    (a0, b0), (a1, b1) = run_ranks(_no_seed, 2)
    np.testing.assert_array_equal(a0, a1)  # one array, not two halves of different streams
    np.testing.assert_array_equal(b0, b1)
    assert not np.array_equal(a0, b0)


def _partial_sum():
    mesh = init_device_mesh("cpu", (2,))
    x = randn(3, 2, device_mesh=mesh, placements=[Partial()], dtype=np.float64, seed=5)
    return x.to_local(), x.full_tensor()


def test_a_partial_sum_keeps_the_value_on_the_first_rank():
    (first, whole0), (second, whole1) = run_ranks(_partial_sum, 2)
    np.testing.assert_array_equal(first, _reference((3, 2), 5, np.float64, True))
    assert not second.any()
    np.testing.assert_array_equal(whole0, first)
    np.testing.assert_array_equal(whole1, first)


def _bad_calls():
    mesh = init_device_mesh("cpu", (2,))
    errors = errors_of(
        (
            lambda: rand(4, device_mesh=mesh, dtype=np.int64, seed=1),
            lambda: randn(4, device_mesh=mesh, seed=-1),
            lambda: rand(4, device_mesh=mesh, seed=2**128),
            lambda: rand(4, device_mesh=mesh, seed=1.5),
            lambda: rand(4, device_mesh=mesh, seed=True),
            lambda: rand(4, seed=1),
            lambda: randn(4, device_mesh=mesh, placements=[Shard(1)], seed=1),
        )
    )
    return errors


def test_bad_dtypes_and_seeds_are_refused_by_name():
    for rank, errors in enumerate(run_ranks(_bad_calls, 2)):
        assert all(e is not None and e.startswith(f"rank {rank}: ") for e in errors), errors
        assert "rand draws floating-point values; got dtype int64" in errors[0]
        for e in errors[1:5]:
            assert "seed is an integer in [0, 2**128)" in e, e
        assert "rand needs device_mesh=" in errors[5]
