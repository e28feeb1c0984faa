"""mpi: a killed rank ends the job promptly and leaves no MPICH shared-memory segment behind
(MPICH unlinks its segment only at a clean end; the plugin removes the name once every rank has
mapped it)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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
if rank == 2:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
for _ in range(1000000):
    pb.all_reduce(x)
"""


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec: pip install mpich")
    return found


@pytest.mark.timeout(90)
def test_a_killed_rank_leaves_no_shared_memory_segment(tmp_path):
    if os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK"):
        pytest.skip("starts its own MPI job")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLURIBUS_", "PMI_"))}
    start = time.monotonic()
    proc = subprocess.Popen(
        [_mpiexec(), "-n", "4", sys.executable, str(script), str(tmp_path)],
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
