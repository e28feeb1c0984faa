"""Bad input gets a clear error before anything is sent, and an error on one rank after its
messages went out fails the group on every rank, never leaves it silently out of step."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus import is_available
from pluribus.errors import PluribusError
from pluribus.testing import run_ranks

WORLD = 4


class CupyLike:
    """Quacks like a cupy array (dtype, flags, shape) without being one."""

    def __init__(self, n: int):
        self._data = np.ones(n, np.float32)
        self.dtype, self.flags, self.shape = self._data.dtype, self._data.flags, self._data.shape
        self.size, self.nbytes, self.strides = self._data.size, self._data.nbytes, (4,)


CupyLike.__module__ = "cupy_like"


class NotAnArray:
    def __init__(self, n: int):
        self._data = np.ones(n, np.float32)
        self.dtype, self.flags, self.shape = self._data.dtype, self._data.flags, self._data.shape


def _array_impostors_then_real_work() -> list[str]:
    said = []
    for impostor in (CupyLike(8), NotAnArray(8)):
        for call in (pb.all_reduce, lambda a: pb.broadcast(a, src=0)):
            try:
                call(impostor)
                said.append("returned")
            except TypeError as exc:
                said.append("TypeError" if f"rank {pb.get_rank()}" in str(exc) else str(exc))
            except Exception as exc:
                said.append(f"{type(exc).__name__}: {exc}")
    for _ in range(3):
        x = np.ones(16, np.float32)
        pb.all_reduce(x)
        said.append("right" if np.all(x == WORLD) else f"wrong sum {x[0]}")
    return said


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["ucc", "gloo"])
def test_array_impostors_are_refused_before_anything_is_sent(backend):
    if not is_available(backend):
        pytest.skip(f"{backend} is not available here")
    results = run_ranks(_array_impostors_then_real_work, WORLD, backend, "processes", timeout=60)
    for rank, said in enumerate(results):
        assert said == ["TypeError"] * 4 + ["right"] * 3, (rank, said)


def _rank_one_fails_after_sending() -> list[str]:
    import pluribus_ucc.backend as ucc_backend

    rank = pb.get_rank()
    said = []
    if rank == 1:
        real = ucc_backend.reduce_into

        def broken(*args):
            ucc_backend.reduce_into = real
            raise RuntimeError("injected: the reduction failed on rank 1")

        ucc_backend.reduce_into = broken
    for _ in range(3):
        x = np.ones(16, np.float32)
        try:
            pb.all_reduce(x)
            said.append("right" if np.all(x == WORLD) else f"wrong sum {x[0]}")
        except PluribusError as exc:  # (a RuntimeError too)
            said.append(
                "failed" if "rank 1" in str(exc) else f"failed without naming rank 1: {exc}"
            )
        except RuntimeError:
            said.append("injected")
    return said


@pytest.mark.timeout(90)
def test_ucc_a_rank_local_error_after_sending_fails_the_group_everywhere():
    if not is_available("ucc"):
        pytest.skip("ucc is not available here")
    results = run_ranks(
        _rank_one_fails_after_sending,
        WORLD,
        "ucc",
        "processes",
        timeout=60,
        env={"PLURIBUS_TIMEOUT": "20"},
    )
    assert results[1] == ["failed"] * 3, results
    for rank in (0, 2, 3):  # the first call may complete where rank 1's part had arrived
        assert results[rank][1:] == ["failed"] * 2, (rank, results[rank])
        assert results[rank][0] in ("right", "failed"), (rank, results[rank])
