"""FSDP on the mpi backend; run under mpiexec, one pytest process per rank:

    mpiexec -n 2 python plugins/mpi/tests/pytest_rank.py -m mpi tests/fsdp/test_fsdp_mpi.py
    mpiexec -n 4 python plugins/mpi/tests/pytest_rank.py -m mpi tests/fsdp/test_fsdp_mpi.py

Outside mpiexec every test skips with the reason.
"""

import mpi_jobs
import pluribus
import pytest
from fsdp_cases import check_matches_reference, fsdp_train_on_rank, reference_train

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.timeout(240),
    mpi_jobs.only_under_mpiexec("tests/fsdp/test_fsdp_mpi.py"),
]


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_fsdp_mpi_equals_single_process_training(mpi_job, strategy):
    [mine] = mpi_job.run(fsdp_train_on_rank, "gpt", strategy, 4, 3)
    everyone = pluribus.all_gather_object(mine)
    check_matches_reference(everyone, reference_train("gpt", pluribus.get_world_size(), 4, 3))
