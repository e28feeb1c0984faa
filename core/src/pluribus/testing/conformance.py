"""The backend conformance suite, as pytest tests.

Run it on a backend by name::

    pytest --pyargs pluribus.testing.conformance --pluribus-backend gloo \
        --pluribus-world-sizes 2,3,4 --pluribus-mode processes

Every check runs on every rank of a pool of ranks that stays up for the whole session (see
:mod:`pluribus.testing.checks` for what each one asserts).
"""

from __future__ import annotations

import pytest

from . import checks
from .harness import RanksFailed

CHECKS = [
    checks.check_all_reduce_ops_dtypes,
    checks.check_all_reduce_large,
    checks.check_all_reduce_into,
    checks.check_reduce,
    checks.check_broadcast,
    checks.check_all_gather,
    checks.check_reduce_scatter,
    checks.check_all_to_all,
    checks.check_gather_scatter,
    checks.check_barrier,
    checks.check_send_recv,
    checks.check_async_ordering,
    checks.check_subgroups,
    checks.check_overlapping_subgroups,
    checks.check_objects,
    checks.check_timeouts,
    checks.check_subgroup_timeout,
    checks.check_bad_input,
    checks.check_every_call_seen,
]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
def test_conformance(pluribus_pool, check):
    pluribus_pool.run(check)


def run_failure_case(pool, check, expected_kinds: dict[int, str]) -> None:
    """Run a check that leaves the world broken, then start the pool afresh."""
    try:
        if expected_kinds:
            with pytest.raises(RanksFailed) as info:
                pool.run(check, timeout=60)
            assert info.value.kinds() == expected_kinds, str(info.value)
        else:
            pool.run(check, timeout=60)
    finally:
        pool.close()


def test_kill_a_rank(pluribus_pool):
    """A rank SIGKILLed inside a collective: every other rank raises PeerError naming it
    within 5 s (ranks in processes only)."""
    if pluribus_pool.mode != "processes" or pluribus_pool.world_size < 2:
        pytest.skip("killing a rank needs ranks in separate processes, at least two")
    run_failure_case(
        pluribus_pool, checks.check_kill_a_rank, {pluribus_pool.world_size - 1: "died"}
    )


def test_abort(pluribus_pool):
    """abort(reason) on one rank reaches every other rank as PeerError within 5 s."""
    if pluribus_pool.mode == "inplace" or pluribus_pool.world_size < 2:
        pytest.skip("abort ends the job under mpiexec; it needs at least two ranks")
    run_failure_case(pluribus_pool, checks.check_abort, {})
