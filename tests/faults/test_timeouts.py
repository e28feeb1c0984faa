"""A rank that never calls a collective: every rank that waited raises DistTimeoutError naming
the collective, its sequence number and the rank that did not arrive (not a PeerError blaming a
live rank)."""

from __future__ import annotations

import time

import numpy as np
import pluribus as pb
import pytest
from pluribus import is_available
from pluribus.errors import DistTimeoutError
from pluribus.testing import run_ranks

WORLD = 4
TIMEOUT = 3.0


def _rank_three_stays_away() -> str:
    rank = pb.get_rank()
    group = pb.new_group(list(range(WORLD)), timeout=TIMEOUT)
    pb.barrier(group=group)  # collective #1
    if rank == 3:
        time.sleep(TIMEOUT + 3)
        return "away"
    x = np.ones(1024, np.float32)
    start = time.monotonic()
    try:
        pb.all_reduce(x, group=group)  # collective #2
    except DistTimeoutError as exc:
        return f"{time.monotonic() - start:.1f}s {exc}"
    except Exception as exc:
        return f"wrong error {type(exc).__name__}: {exc}"
    return "returned"


SETTINGS = {
    "gloo-shm": ("gloo", {"PLURIBUS_GLOO_SHM": "1"}),
    "ucc": ("ucc", {}),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.timeout(60)
def test_timeouts_name_the_ranks_that_did_not_arrive(setting):
    backend, env = SETTINGS[setting]
    if not is_available(backend):
        pytest.skip(f"{backend} is not available here")
    results = run_ranks(_rank_three_stays_away, WORLD, backend, "processes", timeout=40, env=env)
    for rank in range(3):
        message = results[rank]
        assert "rank(s) [3] did not reach it" in message, (rank, message)
        assert "all_reduce" in message and "#2" in message, (rank, message)
        took = float(message.split("s ", 1)[0])
        assert took < TIMEOUT + 2.5, (rank, message)
