"""MPI jobs for the repository-level tests: whether pytest is itself a rank of an mpiexec job
(the tests marked ``mpi`` run only then, one pytest process per rank), and the mpiexec that
tests starting their own job use."""

import os
import shutil
import sys
from pathlib import Path

import pytest

#: what mpiexec (MPICH's hydra, Open MPI, PMIx launchers, Intel MPI) sets in each rank
MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


def under_mpiexec() -> bool:
    return any(v in os.environ for v in MPI_RANK_VARS)


def only_under_mpiexec(test_file: str) -> pytest.MarkDecorator:
    """Skip, saying how to run them, the tests of ``test_file`` outside an mpiexec job."""
    return pytest.mark.skipif(
        not under_mpiexec(),
        reason=f"not running under mpiexec (run: mpiexec -n 2 python "
        f"plugins/mpi/tests/pytest_rank.py -m mpi {test_file})",
    )


def mpiexec() -> str:
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec: pip install mpich (or load your MPI module)")
    return found
