"""Fixtures of the repository-level tests. Being a conftest in a folder without
``__init__.py``, it also puts ``tests/`` on ``sys.path`` (pytest's rule), so that the tests in its
subfolders can import ``example_scripts`` and ``mpi_jobs``."""

import os

import pytest
from pluribus.testing import RankPool, require_backend


@pytest.fixture
def one_blas_thread():
    """Thread ranks share this process's BLAS pool; one thread keeps them from fighting."""
    try:
        from threadpoolctl import threadpool_limits  # comes with scikit-learn
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1):
        yield


@pytest.fixture(scope="module")
def mpi_job():
    """This process as its rank of the mpiexec job, in a one-rank pool on the mpi backend."""
    require_backend("mpi")
    if "RANK" not in os.environ:
        # rank and size from MPI, for cores whose init_process_group does not read them itself
        from pluribus_mpi import setup_env

        setup_env()
    pool = RankPool(1, "mpi", mode="inplace", timeout=120)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def process_pools():
    """``process_pools(backend, world)``: a pool of ``world`` rank processes on ``backend``,
    started once per module and reused by its tests (starting ranks costs seconds)."""
    made: dict = {}

    def get(backend: str, world: int) -> RankPool:
        require_backend(backend)
        if (backend, world) not in made:
            made[(backend, world)] = RankPool(world, backend, mode="processes", timeout=120)
        return made[(backend, world)]

    yield get
    for pool in made.values():
        pool.close()
