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


def _refused(shape, dtype) -> str:
    """The error this rank raises, after which the group still works."""
    with pytest.raises(ValueError) as info:
        pb.empty_symmetric(shape, dtype)
    pb.barrier()
    return str(info.value)


@pytest.mark.timeout(60)
def test_ranks_asking_for_different_arrays_are_refused_on_every_rank():
    def shapes_differ():
        return _refused(4 if pb.get_rank() != 2 else 5, np.float32)

    def dtypes_differ():
        return _refused(4, np.float32 if pb.get_rank() else np.float64)

    for rank, message in enumerate(run_ranks(shapes_differ, 3, "threads")):
        assert message.startswith(f"rank {rank}: empty_symmetric"), message
        assert "rank 0: (4,) float32" in message and "rank 2: (5,) float32" in message
        assert "nothing was allocated" in message
    for message in run_ranks(dtypes_differ, 3, "threads"):
        assert "rank 0: (4,) float64" in message and "rank 1: (4,) float32" in message


def _negative() -> None:
    pb.empty_symmetric((2, -1))


@pytest.mark.timeout(60)
def test_a_negative_shape_is_refused_before_any_exchange():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_negative, 2, "threads")
    assert all("negative shape (2, -1)" in e.message for e in info.value.errors)
