"""mpi: a killed rank ends the job promptly and leaves no MPICH shared-memory segment behind
(MPICH unlinks its segment only at a clean end; the plugin removes the name once every rank has
mapped it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import mpi_jobs
import pytest

JOB = """
import os, signal, sys, time
import numpy as np
import pluribus as pb

pb.init_process_group("mpi", timeout=20)
rank = pb.get_rank()
with open(os.path.join(sys.argv[1], f"segments{rank}"), "w") as f:
    for line in open("/proc/self/maps"):
        f.writelines(w + "\\n" for w in line.split() if w.startswith("/dev/shm/mpich"))
x = np.ones(1 << 18, np.float32)
pb.all_reduce(x)
if rank == int(sys.argv[2]):
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
for _ in range(1000000):
    pb.all_reduce(x)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [2, 0, 3])
def test_a_killed_rank_leaves_no_shared_memory_segment(tmp_path, victim):
    if mpi_jobs.under_mpiexec():
        pytest.skip("starts its own MPI job")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLURIBUS_", "PMI_"))}
    start = time.monotonic()
    proc = subprocess.Popen(
        [mpi_jobs.mpiexec(), "-n", "4", sys.executable, str(script), str(tmp_path), str(victim)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    took = time.monotonic() - start
    assert "BAD TERMINATION" in out, out
    assert took < 30, f"the job took {took:.0f}s to end after a rank was killed"
    names = set()
    for rank in range(4):
        names.update((tmp_path / f"segments{rank}").read_text().split())
    assert names, "MPICH mapped no /dev/shm segment (nothing to check)"
    left = sorted(n for n in names if os.path.exists(n))
    assert not left, f"left behind after the job: {left}"


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
    if mpi_jobs.under_mpiexec():
        pytest.skip("starts its own MPI job")
    script = tmp_path / "mismatch.py"
    script.write_text(textwrap.dedent(MISMATCH))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLURIBUS_", "PMI_"))}
    env["PLURIBUS_DEBUG"] = "DETAIL"
    done = subprocess.run(
        [mpi_jobs.mpiexec(), "-n", "4", sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        start_new_session=True,
    )
    for rank in range(4):
        for case in ("dtype", "op", "root"):
            assert f"rank {rank} {case}: disagree" in done.stdout, done.stdout + done.stderr
        assert f"rank {rank} then: 4" in done.stdout, done.stdout + done.stderr
