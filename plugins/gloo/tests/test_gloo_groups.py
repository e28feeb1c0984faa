"""Sub-groups over the world's connections: overlapping groups, created in the same order on
every rank, keep their traffic apart from each other and from the world."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus.testing import run_ranks


def _overlapping_groups() -> list[float]:
    rank = pb.get_rank()
    low = pb.new_group([0, 1])
    high = pb.new_group([1, 2])
    results = []
    world = np.full(3, float(rank))
    pending = pb.all_reduce(world, async_op=True)  # in flight while the sub-groups run
    if rank in (0, 1):
        x = np.full(1 << 16, rank + 1.0, dtype=np.float32)  # large enough for the ring
        pb.all_reduce(x, group=low)
        results.append(float(x[0]))
    if rank in (1, 2):
        y = np.full(10, rank * 10.0)
        pb.all_reduce(y, group=high)
        results.append(float(y[0]))
        peer = 2 if rank == 1 else 1
        got = np.zeros(4)
        work = pb.isend(np.full(4, float(rank)), peer, group=high, tag=(1 << 24) - 1)
        pb.recv(got, peer, group=high, tag=(1 << 24) - 1)
        work.wait()
        results.append(float(got[0]))
    pending.wait()
    results.append(float(world[0]))
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"])
def test_gloo_overlapping_subgroups(shm):
    got = run_ranks(
        _overlapping_groups, 3, "gloo", "processes", timeout=60, env={"PLURIBUS_GLOO_SHM": shm}
    )
    assert got == [[3.0, 3.0], [3.0, 30.0, 2.0, 3.0], [30.0, 1.0, 3.0]]
