"""ucc and mpi: mismatched dtypes, ops and roots are an error, not silently wrong results.

With ``ucc_check_calls=True`` ucc's small all-reduces and broadcasts (up to ``ucc_small_bytes``,
64 KiB) carry the call's signature at the end of each message; it is off by default because it
costs more than 5 % at 4 KiB (BENCHMARKS.md). PLURIBUS_DEBUG=DETAIL checks every call on every
backend (it failed every ucc collective before the core's tag budget).
"""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus import is_available
from pluribus.errors import PluribusError
from pluribus.testing import run_ranks

WORLD = 4
N = 1024  # 4 KiB of float32


def _run(case: str) -> list[str]:
    """What the mismatched call did, then what a barrier after it did."""
    return [_outcome(case), _outcome("barrier")]


def _outcome(case: str) -> str:
    rank = pb.get_rank()
    try:
        if case == "barrier":
            pb.barrier()
        if case == "dtype":
            x = np.ones(N, np.int32 if rank == 0 else np.float32)
            pb.all_reduce(x)
        elif case == "op":
            x = np.ones(N, np.float32)
            pb.all_reduce(x, op=pb.ReduceOp.MAX if rank == 0 else pb.ReduceOp.SUM)
        elif case == "root":  # rank 3 alone broadcasts from rank 1
            x = np.full(N, float(rank), np.float32)
            pb.broadcast(x, src=1 if rank == 3 else 0)
        elif case == "short":  # after one good all_reduce, rank 0 alone calls barrier
            x = np.ones(N, np.float32)
            pb.all_reduce(x)
            if rank == 0:
                pb.barrier()  # its 1-byte token reaches rank 1's all_reduce first
            else:
                pb.all_reduce(x)
        elif case == "kind":
            x = np.ones(N, np.float32)
            if rank == 0:
                pb.broadcast(x, src=0)
            else:
                pb.all_reduce(x)
    except PluribusError as exc:
        text = str(exc)
        # a rank that reaches its next call before the abort may instead meet the other
        # collective's bytes there: a size mismatch, reported as one
        words = ("mismatch", "aborted", "disagree", "different sizes")
        return "mismatch" if any(w in text for w in words) else text
    return "returned"


CHECKS = {
    "ucc_check_calls": ({}, {"ucc_check_calls": True}),
    "DETAIL": ({"PLURIBUS_DEBUG": "DETAIL"}, {}),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "case, check",
    [
        ("dtype", "ucc_check_calls"),
        ("root", "ucc_check_calls"),
        ("kind", "ucc_check_calls"),
        ("short", "ucc_check_calls"),
        ("op", "DETAIL"),
    ],
)
def test_ucc_mismatches_fail_every_rank(case, check):
    if not is_available("ucc"):
        pytest.skip("ucc is not available here")
    env, options = CHECKS[check]
    results = run_ranks(
        _run,
        WORLD,
        "ucc",
        "processes",
        timeout=60,
        args=(case,),
        env={"PLURIBUS_TIMEOUT": "10", **env},
        backend_options=options,
    )
    if check == "DETAIL":  # every rank refuses before anything is sent: the group stays usable
        assert results == [["mismatch", "returned"]] * WORLD, results
        return
    for rank, (call, then) in enumerate(results):
        # a rank whose own part completed (a root that only sends, a rank that got the data
        # of the root it named) may return before it hears: its next call fails
        assert then == "mismatch", (rank, results)
        if (
            case == "kind"
            and rank
            or case == "root"
            and rank == 3
            or case == "short"
            and rank == 1
            or case in ("dtype", "op")
        ):
            assert call == "mismatch", (rank, results)
