"""DDP and SyncBatchNorm on the mpi backend; run under mpiexec, one pytest process per rank:

    mpiexec -n 2 python -m pytest -m mpi tests/ddp/test_ddp_mpi.py
    mpiexec -n 4 python -m pytest -m mpi tests/ddp/test_ddp_mpi.py

Outside mpiexec every test skips with the reason.
"""

import mpi_jobs
import pluribus
import pytest
from ddp_cases import check_matches_reference, ddp_train_on_rank

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.timeout(240),
    mpi_jobs.only_under_mpiexec("tests/ddp/test_ddp_mpi.py"),
]

SMALL_BUCKETS_MB = 4096 / 2**20


@pytest.mark.parametrize("accum", [1, 2], ids=["sync-every-step", "no_sync-accumulation"])
def test_ddp_mpi_equals_single_process_on_concatenated_batch(mpi_job, accum):
    per_rank, steps = 8, 3
    [mine] = mpi_job.run(ddp_train_on_rank, per_rank, steps, accum, SMALL_BUCKETS_MB)
    everyone = pluribus.all_gather_object(mine)
    assert mine["buckets"] >= 3
    check_matches_reference(everyone, pluribus.get_world_size(), per_rank, steps, accum)


def test_syncbatchnorm_mpi_equals_batchnorm_on_full_batch(mpi_job):
    per_rank, steps = 6, 3
    [mine] = mpi_job.run(ddp_train_on_rank, per_rank, steps, 1, SMALL_BUCKETS_MB, None, True)
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
