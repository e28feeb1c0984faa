"""A rank blocked in a ucc collective sleeps in epoll instead of spinning on a core."""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pluribus as pb
import pytest
from pluribus.testing import run_ranks

# Skip only where ucxx is not installed: installed but unusable is a failure, not a skip.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None,
    reason="ucxx is not installed (pip install pluribus-ucc pulls ucxx-cu12)",
)


def _wait_for_a_late_peer() -> tuple[float, float]:
    x = np.ones(1 << 16, np.float32)
    pb.all_reduce(x)  # connections are up
    if pb.get_rank() == 1:
        time.sleep(1.5)
    wall, cpu = time.monotonic(), time.process_time()
    pb.all_reduce(x)
    assert (x == 4).all()
    return time.monotonic() - wall, time.process_time() - cpu


@pytest.mark.timeout(90)
def test_a_waiting_rank_uses_almost_no_cpu():
    (wall, cpu), _ = run_ranks(_wait_for_a_late_peer, 2, "ucc", mode="processes", timeout=60)
    assert wall > 1.0, "rank 0 should have waited for the late rank"
    assert cpu < 0.25 * wall, f"rank 0 burned {cpu:.2f}s of CPU in {wall:.2f}s of waiting"


def _tcp_only_job() -> str:
    rank = pb.get_rank()
    x = np.arange(1 << 20, dtype=np.float32) + rank
    pb.all_reduce(x)
    assert (x == 2 * np.arange(1 << 20, dtype=np.float32) + 1).all()
    got = np.zeros(1000)
    w = pb.isend(np.full(1000, float(rank)), 1 - rank, tag=4)
    pb.recv(got, 1 - rank, tag=4)
    w.wait()
    assert (got == 1 - rank).all()
    return "ok"


@pytest.mark.timeout(90)
def test_tcp_only_with_ucx_error_handling():
    """What a multi-host job without RDMA gets: UCX over TCP, with UCX's own peer-failure mode."""
    options = {"ucc_config": {"TLS": "tcp,self"}, "ucc_error_handling": True}
    assert run_ranks(
        _tcp_only_job, 2, "ucc", mode="processes", timeout=60, backend_options=options
    ) == ["ok", "ok"]
