"""MPI jobs started from the test: failure handling, start-up checks, and the plugin's own
tests under ``mpiexec -n 2``. Each runs outside an MPI job (it starts one)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from mpi_test_support import REPO, mpiexec, outside_mpi_job, run_job, run_mpiexec, run_python

JOB_PRELUDE = """
import os, sys, time
import numpy as np
import pluribus as pb
import pluribus_mpi

pluribus_mpi.setup_env()
"""


@pytest.fixture(autouse=True)
def _not_in_a_job():
    outside_mpi_job()


@pytest.mark.timeout(60)
def test_uncaught_exception_aborts_every_rank_with_the_traceback(tmp_path):
    script = (
        JOB_PRELUDE
        + """
pb.init_process_group("mpi", timeout=120)
pb.barrier()
if pb.get_rank() == 1:
    time.sleep(0.2)
    raise RuntimeError("boom from rank 1")
x = np.ones(4)
while True:  # rank 0 waits in a collective rank 1 never joins
    pb.all_reduce(x)
"""
    )
    start = time.monotonic()
    job = run_mpiexec(2, script, tmp_path, timeout=45)
    elapsed = time.monotonic() - start
    output = job.stdout + job.stderr
    assert job.returncode != 0, output
    assert "RuntimeError: boom from rank 1" in output
    assert "Traceback (most recent call last)" in output
    assert "uncaught exception on rank 1 of 2" in output
    assert "MPI_Abort" in output
    assert elapsed < 20, f"the job took {elapsed:.1f}s to end"


@pytest.mark.timeout(60)
def test_collective_timeout_raises_and_ends_the_job(tmp_path):
    script = (
        JOB_PRELUDE
        + """
pb.init_process_group("mpi", timeout=1.0)
if pb.get_rank() == 1:
    time.sleep(30)  # never joins
pb.all_reduce(np.ones(3))
"""
    )
    start = time.monotonic()
    job = run_mpiexec(2, script, tmp_path, timeout=45)
    elapsed = time.monotonic() - start
    output = job.stdout + job.stderr
    assert job.returncode != 0, output
    assert "DistTimeoutError" in output and "did not complete within 1.0s" in output
    assert "rank 0: all_reduce(shape=(3,), dtype=float64) on group 'world'" in output
    assert elapsed < 20, f"the job took {elapsed:.1f}s to end"


@pytest.mark.timeout(60)
def test_rank_variables_that_disagree_with_mpi_are_refused(tmp_path):
    script = (
        JOB_PRELUDE.replace("pluribus_mpi.setup_env()\n", "")
        + """
pluribus_mpi.setup_env()
"""
    )
    job = run_mpiexec(2, script, tmp_path, timeout=45, genv={"RANK": "0", "WORLD_SIZE": "2"})
    output = job.stdout + job.stderr
    assert job.returncode != 0, output
    assert "rank 1: RANK=0 disagrees with MPI, whose rank for this process is 1" in output


@pytest.mark.timeout(60)
def test_explicit_rank_that_disagrees_with_mpi_is_refused(tmp_path):
    script = """
import pluribus as pb
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
pb.init_process_group("mpi", rank=1 - rank, world_size=2, store=pb.HashStore())
"""
    job = run_mpiexec(2, script, tmp_path, timeout=45)
    output = job.stdout + job.stderr
    assert job.returncode != 0, output
    assert "disagrees with MPI, which runs this process as rank" in output


@pytest.mark.timeout(60)
def test_world_larger_than_the_mpi_job_says_to_use_mpiexec():
    result = run_python(
        """
        import pluribus as pb
        try:
            pb.init_process_group("mpi", rank=0, world_size=2, store=pb.HashStore())
        except pb.PluribusError as exc:
            print("refused:", exc)
        """
    )
    assert "refused:" in result.stdout, result.stderr
    assert "mpiexec -n 2 python train.py" in result.stdout
    assert "pluribus-run" in result.stdout


@pytest.mark.timeout(60)
def test_single_process_world_works_without_mpiexec():
    result = run_python(
        """
        import numpy as np
        import pluribus as pb
        from pluribus_mpi.backend import MPIBackend
        from pluribus_mpi.work import MPIWork
        pb.init_process_group("mpi", rank=0, world_size=1, store=pb.HashStore())
        assert isinstance(pb.get_default_group().backends["cpu"], MPIBackend)
        x = np.arange(5.0)
        pb.all_reduce(x, pb.ReduceOp.AVG)
        work = pb.broadcast(x, 0, async_op=True)
        assert isinstance(work, MPIWork) and work.wait()
        out = np.zeros(5)
        pb.all_gather(out, x)
        assert (out == np.arange(5.0)).all()
        pb.destroy_process_group()
        print("ok")
        """
    )
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.timeout(170)
def test_plugin_tests_and_conformance_pass_under_mpiexec_with_two_ranks():
    """The ``mpi``-marked tests, run as run_mpi_tests.sh runs them (it adds 3 and 4 ranks)."""
    tests = REPO / "plugins" / "mpi" / "tests"
    command = [
        mpiexec(),
        "-n",
        "2",
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "mpi",
        str(tests / "test_mpi_collectives.py"),
        str(tests / "test_mpi_conformance.py"),
        "--pluribus-backend",
        "mpi",
        "--pluribus-mode",
        "inplace",
    ]
    command[3] = sys.executable
    job = run_job(command, timeout=150)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-6000:]
    passed = [int(n) for n in re.findall(r"(\d+) passed", output)]
    assert len(passed) == 2 and min(passed) >= 25, output[-3000:]  # one summary per rank


@pytest.mark.timeout(60)
def test_rendezvous_hook_gives_each_rank_a_shared_store(tmp_path):
    script = """
import numpy as np
import pluribus as pb
from pluribus_mpi.plugin import pluribus_rendezvous

store, rank, size = pluribus_rendezvous(None, None, None, 30.0, {"cpu": "mpi"})
store.set(f"hello/{rank}", str(rank * 10))
assert [int(store.get(f"hello/{r}")) for r in range(size)] == [r * 10 for r in range(size)]
pb.init_process_group("mpi", rank=rank, world_size=size, store=store)
x = np.ones(3)
pb.all_reduce(x)
assert (x == size).all()
pb.barrier()
pb.destroy_process_group()
with open(f"{sys.argv[1]}/rank{rank}", "w") as done:
    done.write(f"rank {rank} of {size} ok")
"""
    job = run_mpiexec(3, "import sys\n" + script, tmp_path, timeout=45, args=[str(tmp_path)])
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    for rank in range(3):
        assert (tmp_path / f"rank{rank}").read_text() == f"rank {rank} of 3 ok"


@pytest.mark.timeout(60)
def test_plain_init_under_mpiexec_needs_no_environment(tmp_path):
    """``init_process_group("mpi")`` alone: rank, size and the store come from the MPI job
    through the plugin's ``pluribus_rendezvous`` hook."""
    script = """
import numpy as np
import pluribus as pb

pb.init_process_group("mpi")
x = np.array([pb.get_rank() + 1.0])
pb.all_reduce(x)
print(f"rank {pb.get_rank()} of {pb.get_world_size()}: {x[0]}", flush=True)
pb.destroy_process_group()
"""
    job = run_mpiexec(3, script, tmp_path, timeout=45)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    for r in range(3):
        assert f"rank {r} of 3: 6.0" in output


#: a process that leaves its parent's session (as mpiexec's proxy and ranks do) and maps an
#: MPICH-named segment until it is killed
_SEGMENT_HOLDER = """
import mmap, os, sys, time
os.setsid()
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
held = mmap.mmap(fd, 4096)
time.sleep(30)
"""


@pytest.mark.timeout(60)
def test_a_job_past_its_time_is_killed_whole_and_its_segments_removed():
    segment = f"/dev/shm/mpich_shm_pluribus_test_{time.monotonic_ns()}"
    parent = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {_SEGMENT_HOLDER!r}, {segment!r}],\n"
        "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "time.sleep(30)\n"
    )
    with pytest.raises(AssertionError, match="still running after 3s"):
        run_job([sys.executable, "-c", parent], timeout=3)
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if segment.encode() in cmdline.read_bytes():
                left.append(cmdline.parent.name)
        except OSError:
            continue
    assert not left, f"processes of the job still running: {left}"
    assert not Path(segment).exists()
