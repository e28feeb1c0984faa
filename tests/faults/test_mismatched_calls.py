"""Mismatched collectives give an error on every rank, never silently different data.

Gloo's 64-byte header names the collective, its step in the group and its root; a rank that
receives a message for another collective or another root fails the group. Run on 4 real
processes, over shared memory and over TCP.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pluribus as pb
import pytest
from pluribus.errors import CollectiveMismatchError
from pluribus.testing import run_ranks

WORLD = 4
TRANSPORTS = pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "tcp"])


def _outcome(call) -> str:
    try:
        call()
    except CollectiveMismatchError as exc:
        return f"mismatch: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def _on_gloo(fn, shm: str) -> list:
    """``fn`` on every rank of a fresh 4-process gloo job, shared memory on or off."""
    return run_ranks(
        fn,
        WORLD,
        "gloo",
        "processes",
        timeout=40,
        env={"PLURIBUS_GLOO_SHM": shm, "PLURIBUS_TIMEOUT": "20"},
    )


def _broadcast_with_different_roots() -> dict:
    rank = pb.get_rank()
    x = np.full(4, float(rank), np.float32)
    if rank == 1:
        time.sleep(0.5)  # rank 0's message reaches ranks 1 and 2 before rank 1's does
    first = _outcome(lambda: pb.broadcast(x, src=0 if rank == 0 else 1))
    then = _outcome(pb.barrier)
    return {"broadcast": first, "barrier": then, "data": x.tolist()}


@TRANSPORTS
@pytest.mark.timeout(60)
def test_broadcast_roots_that_differ_fail_the_broadcast(shm):
    results = _on_gloo(_broadcast_with_different_roots, shm)
    for rank, result in enumerate(results):
        assert result["barrier"].startswith("mismatch"), (rank, result)
        if rank:  # every rank that received something raises in the broadcast itself
            assert result["broadcast"].startswith("mismatch"), (rank, result)
    named = " ".join(r["broadcast"] for r in results)
    assert re.search(r"root[= ]0", named) and re.search(r"root[= ]1", named), named


def _broadcast_against_all_reduce() -> dict:
    rank = pb.get_rank()
    x = np.full(4, float(rank), np.float32)
    if rank == 0:
        time.sleep(0.5)  # the others' all_reduce messages are waiting when rank 0 starts
        first = _outcome(lambda: pb.broadcast(x, src=0))
    else:
        first = _outcome(lambda: pb.all_reduce(x))
    return {"call": first, "barrier": _outcome(pb.barrier)}


@pytest.mark.parametrize("shm", ["1"], ids=["shm"])
@pytest.mark.timeout(60)
def test_the_root_of_a_broadcast_learns_that_the_others_called_all_reduce(shm):
    results = _on_gloo(_broadcast_against_all_reduce, shm)
    for rank, result in enumerate(results):
        assert result["call"].startswith("mismatch"), (rank, result)
        assert result["barrier"].startswith("mismatch"), (rank, result)
    assert "broadcast" in results[0]["call"] and "all_reduce" in results[0]["call"]
