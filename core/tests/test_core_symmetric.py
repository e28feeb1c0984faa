"""``pluribus.empty_symmetric`` in the core: the same checks on every backend, and a plain
``np.empty`` from backends that cannot share memory (the threads backend here; gloo's shared
arrays are tested with the gloo plugin, mpi's plain ones under mpiexec)."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus.testing import RanksFailed, run_ranks


def _allocate_and_reduce() -> tuple:
    rank = pb.get_rank()
    x = pb.empty_symmetric((3, 4), np.int64)
    y = pb.empty_symmetric(5)
    x[...] = rank + 1
    pb.all_reduce(x)
    return type(x), x.shape, x.dtype, x.flags.owndata, int(x[0, 0]), y.shape, y.dtype


@pytest.mark.timeout(60)
def test_backends_without_shared_memory_give_plain_arrays():
    for got in run_ranks(_allocate_and_reduce, 3, "threads"):
        assert got == (np.ndarray, (3, 4), np.int64, True, 6, (5,), np.float32)


def _shapes_differ() -> None:
    pb.empty_symmetric(4 if pb.get_rank() != 2 else 5, np.float32)


def _dtypes_differ() -> None:
    pb.empty_symmetric(4, np.float32 if pb.get_rank() else np.float64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "fn, named",
    [
        (_shapes_differ, ["rank 0: (4,) float32", "rank 2: (5,) float32"]),
        (_dtypes_differ, ["rank 0: (4,) float64", "rank 1: (4,) float32"]),
    ],
)
def test_ranks_asking_for_different_arrays_are_refused_on_every_rank(fn, named):
    with pytest.raises(RanksFailed) as info:
        run_ranks(fn, 3, "threads")
    errors = info.value.errors
    assert sorted(e.rank for e in errors) == [0, 1, 2]
    for error in errors:
        assert error.kind == "ValueError", error
        assert f"rank {error.rank}: empty_symmetric" in error.message
        assert all(part in error.message for part in named), error.message


def _negative() -> None:
    pb.empty_symmetric((2, -1))


@pytest.mark.timeout(60)
def test_a_negative_shape_is_refused_before_any_exchange():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_negative, 2, "threads")
    assert all("negative shape (2, -1)" in e.message for e in info.value.errors)
