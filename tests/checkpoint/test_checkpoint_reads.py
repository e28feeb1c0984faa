"""Each rank reads only the byte ranges it needs, planned without collectives: loading costs
two small exchanges of outcomes, whatever the layouts."""

from __future__ import annotations

import importlib
import math
import os
import threading
from collections import Counter

import numpy as np
import pluribus as pb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pluribus import checkpoint
from pluribus.dtensor import Shard, distribute_tensor, init_device_mesh
from pluribus.dtensor.boxes import regrouped
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

SHAPE = (1000, 64)  # float32: 250 KiB, 256 B a row
BLOCK = 4096


def _save(path, dim):
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    full = np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    checkpoint.save({"w": distribute_tensor(full, mesh, [Shard(dim)])}, path)


def _load(path, dim):
    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    target = distribute_tensor(np.zeros(SHAPE, np.float32), mesh, [Shard(dim)])
    checkpoint.load({"w": target}, path)
    full = np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    np.testing.assert_array_equal(
        target.to_local(), full[target.layout.local_slices(mesh.coordinate)]
    )
    return target.to_local().nbytes


@pytest.mark.parametrize("saved, loaded", [(4, 3), (3, 4), (2, 2)])
def test_each_rank_reads_its_rows_and_at_most_a_block_more_per_chunk(
    tmp_path, monkeypatch, saved, loaded
):
    monkeypatch.setattr(importlib.import_module("pluribus.checkpoint.save"), "BLOCK_BYTES", BLOCK)
    path = str(tmp_path / "c")
    run_ranks(_save, saved, args=(path, 0))
    read: Counter = Counter()
    preadv = os.preadv

    def counting(fd, buffers, offset, *rest):
        n = preadv(fd, buffers, offset, *rest)
        read[threading.current_thread().name] += n
        return n

    monkeypatch.setattr(os, "preadv", counting)
    needs = run_ranks(_load, loaded, args=(path, 0))
    for rank, need in enumerate(needs):
        chunks = -(-saved // loaded) + 1  # the saved pieces one loading piece can overlap
        assert need <= read[f"rank{rank}"] <= need + 2 * BLOCK * chunks, (rank, read, needs)
    assert sum(read.values()) < 1.5 * math.prod(SHAPE) * 4


def test_loading_exchanges_only_its_outcome(tmp_path, monkeypatch):
    """Two all_gather_object calls (two all-gathers each: sizes, then bytes), in any layout."""
    from pluribus import distributed

    path = str(tmp_path / "c")
    run_ranks(_save, 4, args=(path, 1))
    calls: Counter = Counter()
    original = distributed.all_gather

    def counted(*args, **kwargs):
        calls[threading.current_thread().name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(distributed, "all_gather", counted)
    run_ranks(_load, 3, args=(path, 0))
    assert calls == {"rank0": 4, "rank1": 4, "rank2": 4}


@st.composite
def _regrouped_case(draw):
    """A tensor saved as (k, m, *rest) or (k * m, *rest), the other form, and a box of it."""
    k, m = draw(st.integers(1, 4)), draw(st.integers(0, 5))
    rest = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    blocked, merged = (k, m, *rest), (k * m, *rest)
    saved, shape = (blocked, merged) if draw(st.booleans()) else (merged, blocked)
    offsets, sizes = [], []
    for n in shape:
        lo = draw(st.integers(0, n))
        offsets.append(lo)
        sizes.append(draw(st.integers(0, n - lo)))
    return saved, shape, (tuple(offsets), tuple(sizes))


@settings(max_examples=200, deadline=None)
@given(_regrouped_case())
def test_a_box_of_one_form_is_found_in_the_other(case):
    """Each part of the box, read from the saved form, holds the box's elements in place, and
    the parts cover the box exactly once."""
    saved, shape, (offsets, sizes) = case
    tensor = np.arange(math.prod(saved)).reshape(saved)
    box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
    want = tensor.reshape(shape)[box]
    got = np.full(want.shape, -1)
    for index, (o, n) in regrouped((offsets, sizes), shape, saved):
        part = got[index].reshape(n)
        assert np.shares_memory(part, got) or part.size == 0
        assert (part == -1).all()  # not filled twice
        part[...] = tensor[tuple(slice(a, a + b) for a, b in zip(o, n, strict=True))]
    np.testing.assert_array_equal(got, want)


def test_shapes_that_are_no_regrouping_are_refused():
    assert regrouped(((0, 0), (4, 4)), (4, 4), (2, 8)) is None
    assert regrouped(((0,), (6,)), (6,), (4, 2)) is None
    assert regrouped(((), ()), (), (3,)) is None  # 0-d has no leading dimension
    assert regrouped(((0,), (1,)), (1,), ()) is None


def _scalar_into_a_vector(path):
    checkpoint.save({"x": np.array(1.0)}, path)
    try:
        checkpoint.load({"x": np.zeros(1)}, path)
    except checkpoint.CheckpointError as e:
        return str(e)


def test_a_scalar_into_a_vector_is_refused_with_the_shapes(tmp_path):
    for rank, error in enumerate(run_ranks(_scalar_into_a_vector, 2, args=(str(tmp_path / "s"),))):
        assert error is not None and error.startswith(f"rank {rank}: loading ")
        assert "'x' is saved as [] float64, but the state dict holds [1] float64" in error
