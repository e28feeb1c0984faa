"""One tag budget in the core: PLURIBUS_DEBUG=DETAIL (which adds its own tags) works on every
backend, and a backend that cannot carry the budget is refused when a group is created."""

from __future__ import annotations

import numpy as np
import pluribus as pb
import pytest
from pluribus import is_available
from pluribus.backend import MAX_TAG, Backend, check_tag_budget
from pluribus.errors import CollectiveMismatchError
from pluribus.testing import run_ranks

WORLD = 4


def _collectives_under_detail() -> list:
    rank, size = pb.get_rank(), pb.get_world_size()
    x = np.full(1000, rank + 1.0, np.float32)
    pb.all_reduce(x)
    assert np.all(x == size * (size + 1) / 2)
    y = np.full(10, float(rank), np.float64)
    pb.broadcast(y, src=2)
    assert np.all(y == 2.0)
    sub = pb.new_group([1, 2, 3])
    if rank:
        z = np.full(5, float(rank), np.float32)
        pb.all_reduce(z, group=sub)
        assert np.all(z == 6.0)
    # the check still catches a mismatch
    try:
        pb.broadcast(np.zeros(3, np.float32), src=0 if rank == 0 else 1)
    except CollectiveMismatchError:
        return ["mismatch"]
    return ["returned"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["ucc", "gloo"])
def test_detail_checks_run_on_every_backend(backend):
    if not is_available(backend):
        pytest.skip(f"{backend} is not available here")
    results = run_ranks(
        _collectives_under_detail,
        WORLD,
        backend,
        "processes",
        timeout=60,
        env={"PLURIBUS_DEBUG": "DETAIL"},
    )
    assert results == [["mismatch"]] * WORLD


class _NarrowBackend(Backend):
    name = "narrow"
    max_tag = (1 << 25) - 1  # cannot carry the debug aids' tags


def test_a_backend_that_cannot_carry_the_budget_is_refused():
    with pytest.raises(ValueError, match="narrow backend carries tags up to"):
        check_tag_budget(_NarrowBackend(0, 1, 5.0), 0)
    check_tag_budget(Backend(0, 1, 5.0), 0)  # None: any tag

    class _Wide(Backend):
        max_tag = MAX_TAG

    check_tag_budget(_Wide(0, 1, 5.0), 0)
