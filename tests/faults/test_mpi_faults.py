"""mpi: mismatched calls under DETAIL, and a rank that never arrives: the ranks that waited name
it (the watchdog before MPI_Abort, or, with MPI_Abort off, the DistTimeoutError they raise
before ending the job, as MPI_Finalize would wait for that rank). A killed rank is in
test_dead_peers.py (named in the job's output, nothing left behind)."""

from __future__ import annotations

import time

import mpi_jobs
import pytest

MISMATCH = """
import numpy as np
import pluribus as pb

pb.init_process_group("mpi", timeout=20)
rank = pb.get_rank()
cases = {
    "dtype": lambda: pb.all_reduce(np.ones(1024, np.int32 if rank == 0 else np.float32)),
    "op": lambda: pb.all_reduce(
        np.ones(1024, np.float32), op=pb.ReduceOp.MAX if rank == 0 else pb.ReduceOp.SUM
    ),
    "root": lambda: pb.broadcast(np.ones(1024, np.float32), src=1 if rank == 3 else 0),
}
for name, call in cases.items():
    try:
        call()
        print(f"rank {rank} {name}: returned", flush=True)
    except Exception as exc:
        said = "disagree" if "disagree" in str(exc) else str(exc)
        print(f"rank {rank} {name}: {said}", flush=True)
x = np.ones(4, np.float32)
pb.all_reduce(x)
print(f"rank {rank} then: {x[0]:.0f}", flush=True)
pb.destroy_process_group()
"""


@pytest.mark.timeout(90)
def test_detail_catches_dtype_op_and_root_mismatches_on_mpi(tmp_path):
    done = mpi_jobs.run_script(tmp_path, MISMATCH, 4, {"PLURIBUS_DEBUG": "DETAIL"}, timeout=60)
    for rank in range(4):
        for case in ("dtype", "op", "root"):
            assert f"rank {rank} {case}: disagree" in done.stdout, done.stdout + done.stderr
        assert f"rank {rank} then: 4" in done.stdout, done.stdout + done.stderr


STRAGGLER = """
import sys, time
import numpy as np
import pluribus as pb
from pluribus.errors import DistTimeoutError

pb.init_process_group("mpi", timeout=3)
rank = pb.get_rank()
pb.barrier()
if rank == 3:
    time.sleep(60)  # never arrives while the others wait
    sys.exit(0)
start = time.monotonic()
try:
    pb.all_reduce(np.ones(1024, np.float32))
except DistTimeoutError as exc:
    print(f"rank {rank} raised after {time.monotonic() - start:.1f}s: {exc}", flush=True)
    raise
"""


@pytest.mark.timeout(90)
def test_with_abort_the_watchdog_names_the_absent_rank_before_ending_the_job(tmp_path):
    start = time.monotonic()
    done = mpi_jobs.run_script(tmp_path, STRAGGLER, 4, {}, timeout=75)
    took = time.monotonic() - start
    out = done.stdout + done.stderr
    reports = [line for line in out.splitlines() if "pluribus-mpi: DistTimeoutError" in line]
    # the first rank whose watchdog expires aborts the job, so the others may not get to print
    assert reports, out
    for line in reports:
        assert "all_reduce(shape=(1024,), dtype=float32)" in line and "#2 " in line, out
        assert "rank(s) [3] did not reach it" in line, out
    assert "calls MPI_Abort" in out, out
    assert took < 30, f"the job took {took:.0f}s: the ranks waited for rank 3 to end ({out})"
    assert done.returncode != 0, out


@pytest.mark.timeout(90)
def test_without_abort_the_ranks_that_waited_name_the_absent_rank_and_end(tmp_path):
    start = time.monotonic()
    env = {"PLURIBUS_MPI_ABORT_ON_ERROR": "0"}
    done = mpi_jobs.run_script(tmp_path, STRAGGLER, 4, env, timeout=75)
    took = time.monotonic() - start
    out = done.stdout + done.stderr
    raised = [line for line in out.splitlines() if " raised after " in line]
    # the first rank that exits ends the job, so the others may not get to print
    assert raised, out
    for line in raised:
        assert "all_reduce" in line and "#2" in line, out
        assert "rank(s) [3] did not reach it" in line, out
        assert float(line.split(" raised after ")[1].split("s:")[0]) < 3 + 7, out  # timeout 3 s
    assert "exits without MPI_Finalize" in out, out
    assert took < 30, f"the job took {took:.0f}s: the ranks waited for rank 3 to end ({out})"
    assert done.returncode != 0, out


HOST0_AWAY = """
import os, sys, time

os.environ["PLURIBUS_MPI_HOST"] = f"host{int(os.environ['PMI_RANK']) // 2}"  # two "hosts"
import numpy as np
import pluribus as pb

pb.init_process_group("mpi", timeout=3)
pb.barrier()
if pb.get_rank() < 2:
    time.sleep(60)  # host0's ranks never arrive
    sys.exit(0)
pb.all_reduce(np.ones(1024, np.float32))
"""


@pytest.mark.timeout(90)
def test_on_two_hosts_ranks_that_say_why_they_end_get_no_rank_blamed(tmp_path):
    """Ranks 2 and 3 ("host1") time out, say why and exit; mpiexec then kills host0's ranks,
    which host0's watcher must not report as dead: the hub hears that host1 spoke first."""
    env = {"PLURIBUS_MPI_ABORT_ON_ERROR": "0"}
    done = mpi_jobs.run_script(tmp_path, HOST0_AWAY, 4, env, timeout=75)
    out = done.stdout + done.stderr
    assert "rank(s) [0, 1] did not reach it" in out and "exits without MPI_Finalize" in out, out
    assert "without finishing" not in out, out
    assert done.returncode != 0, out
