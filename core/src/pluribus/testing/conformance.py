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

CHECKS = [
    checks.check_all_reduce_ops_dtypes,
    checks.check_all_reduce_large,
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
    checks.check_bad_input,
    checks.check_every_call_seen,
]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
def test_conformance(pluribus_pool, check):
    pluribus_pool.run(check)
