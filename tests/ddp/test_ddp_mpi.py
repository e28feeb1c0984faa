"""DDP and SyncBatchNorm on the mpi backend; run under mpiexec, one pytest process per rank:

    mpiexec -n 2 python -m pytest -m mpi tests/ddp/test_ddp_mpi.py
    mpiexec -n 4 python -m pytest -m mpi tests/ddp/test_ddp_mpi.py

Outside mpiexec every test skips with the reason.
"""

import os

import pluribus
import pytest
from ddp_cases import check_matches_reference, ddp_train_on_rank
from pluribus.testing import RankPool, require_backend

MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not any(v in os.environ for v in MPI_RANK_VARS),
        reason="not running under mpiexec (run: mpiexec -n 2 python -m pytest -m mpi "
        "tests/ddp/test_ddp_mpi.py)",
    ),
]

SMALL_BUCKETS_MB = 4096 / 2**20


@pytest.fixture(scope="module")
def job():
    require_backend("mpi")
    if "RANK" not in os.environ:
        # rank and size from MPI, for cores whose init_process_group does not read them itself
        from pluribus_mpi import setup_env

        setup_env()
    pool = RankPool(1, "mpi", mode="inplace", timeout=120)
    yield pool
    pool.close()


@pytest.mark.parametrize("accum", [1, 2], ids=["sync-every-step", "no_sync-accumulation"])
def test_ddp_mpi_equals_single_process_on_concatenated_batch(job, accum):
    per_rank, steps = 8, 3
    [mine] = job.run(ddp_train_on_rank, per_rank, steps, accum, SMALL_BUCKETS_MB)
    everyone = pluribus.all_gather_object(mine)
    assert mine["buckets"] >= 3
    check_matches_reference(everyone, pluribus.get_world_size(), per_rank, steps, accum)


def test_syncbatchnorm_mpi_equals_batchnorm_on_full_batch(job):
    per_rank, steps = 6, 3
    [mine] = job.run(ddp_train_on_rank, per_rank, steps, 1, SMALL_BUCKETS_MB, None, True)
    everyone = pluribus.all_gather_object(mine)
    check_matches_reference(
        everyone,
        pluribus.get_world_size(),
        per_rank,
        steps,
        1,
        batchnorm=True,
        rtol=1e-4,
        atol=1e-5,
    )
