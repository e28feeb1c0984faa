"""Shared set-up for the mpi plugin's tests.

Tests marked ``mpi`` need this pytest process to be one rank of an MPI job (run_mpi_tests.sh
starts pytest with ``mpiexec -n N``); elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import pytest
from mpi_test_support import TEST_TIMEOUT
from pluribus_mpi.env import in_mpi_job


def pytest_configure(config):
    if in_mpi_job():
        # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from MPI, so that a plain
        # init_process_group("mpi") works (the conformance suite's inplace mode calls that).
        from pluribus_mpi import setup_env

        setup_env()


def pytest_collection_modifyitems(config, items):
    if in_mpi_job():
        return
    skip = pytest.mark.skip(
        reason="needs to run under mpiexec: plugins/mpi/tests/run_mpi_tests.sh runs these with "
        "mpiexec -n 2, 3 and 4"
    )
    for item in items:
        if item.get_closest_marker("mpi") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def mpi_world():
    """The MPI job's world group, shared by every test of this session (and by the conformance
    suite, whose inplace mode reuses an initialised world)."""
    import pluribus as pb

    if not pb.is_initialized():
        pb.init_process_group("mpi", timeout=TEST_TIMEOUT)
    return pb.get_default_group()
