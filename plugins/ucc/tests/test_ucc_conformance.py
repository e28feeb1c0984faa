"""The core's backend conformance suite on ``ucc``, with real processes at world sizes 2 to 4."""

from __future__ import annotations

import importlib.util

import pytest
from pluribus.testing import RankPool, checks
from pluribus.testing.conformance import CHECKS, run_failure_case

# Skip only where ucxx is not installed: installed but unusable is a failure, not a skip.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None,
    reason="ucxx is not installed (pip install pluribus-ucc pulls ucxx-cu12)",
)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def pool(request):
    with RankPool(request.param, "ucc", "processes", timeout=60) as ranks:
        yield ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
def test_ucc_conformance(pool, check):
    pool.run(check)


@pytest.mark.timeout(120)
def test_ucc_kill_a_rank(pool):
    run_failure_case(pool, checks.check_kill_a_rank, {pool.world_size - 1: "died"})


@pytest.mark.timeout(120)
def test_ucc_abort(pool):
    run_failure_case(pool, checks.check_abort, {})
