"""FSDP on the mpi backend; run under mpiexec, one pytest process per rank:

    mpiexec -n 2 python plugins/mpi/tests/pytest_rank.py -m mpi tests/fsdp/test_fsdp_mpi.py
    mpiexec -n 4 python plugins/mpi/tests/pytest_rank.py -m mpi tests/fsdp/test_fsdp_mpi.py

Outside mpiexec every test skips with the reason.
"""

import os

import pluribus
import pytest
from fsdp_cases import check_matches_reference, fsdp_train_on_rank, reference_train
from pluribus.testing import RankPool, require_backend

MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not any(v in os.environ for v in MPI_RANK_VARS),
        reason="not running under mpiexec (run: mpiexec -n 2 python "
        "plugins/mpi/tests/pytest_rank.py -m mpi tests/fsdp/test_fsdp_mpi.py)",
    ),
]


@pytest.fixture(scope="module")
def job():
    require_backend("mpi")
    if "RANK" not in os.environ:
        from pluribus_mpi import setup_env

        setup_env()
    pool = RankPool(1, "mpi", mode="inplace", timeout=120)
    yield pool
    pool.close()


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_fsdp_mpi_equals_single_process_training(job, strategy):
    [mine] = job.run(fsdp_train_on_rank, "gpt", strategy, 4, 3)
    everyone = pluribus.all_gather_object(mine)
    check_matches_reference(everyone, reference_train("gpt", pluribus.get_world_size(), 4, 3))
