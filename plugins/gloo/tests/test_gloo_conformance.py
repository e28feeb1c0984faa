"""The core conformance suite on gloo, with real processes, shared memory on and off."""

from __future__ import annotations

import pytest
from pluribus.testing import RankPool
from pluribus.testing.conformance import CHECKS

CONFIGS = [(2, "1"), (3, "1"), (4, "1"), (2, "0"), (3, "0"), (4, "0")]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"world{n}-shm{s}" for n, s in CONFIGS])
def gloo_pool(request):
    size, shm = request.param
    pool = RankPool(size, "gloo", "processes", timeout=90, env={"PLURIBUS_GLOO_SHM": shm})
    yield pool
    pool.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
def test_gloo_conformance(gloo_pool, check):
    gloo_pool.run(check)
