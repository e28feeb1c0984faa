"""Helpers for the mpi plugin's tests (a module of its own: conftest is not importable by name
when several test folders have one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pluribus_mpi.env import in_mpi_job, mpiexec_path

#: The environment variable that marks every process of a job a test starts (mpiexec's proxy
#: and the ranks run in sessions of their own; this is how the harness finds them all).
JOB_VARIABLE = "PLURIBUS_TEST_JOB"
#: Seconds a collective may wait in these tests before it raises DistTimeoutError.
TEST_TIMEOUT = 60.0
REPO = Path(__file__).resolve().parents[3]


def mpiexec() -> str:
    """The mpiexec this job would use (:func:`pluribus_mpi.env.mpiexec_path`); skips if none."""
    found = mpiexec_path()
    if found is None:
        pytest.skip("no mpiexec: pip install mpich (or load your MPI module)")
    return found


def outside_mpi_job() -> None:
    """Skip a test that starts its own processes when pytest itself is an MPI rank."""
    if in_mpi_job():
        pytest.skip("starts its own processes: runs in the plain pytest run, not under mpiexec")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher or rendezvous variables, plus ``extra``."""
    drop = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PMI_",
        "OMPI_",
        "PMIX_",
        "MV2_",
        "HYDRA_",
        "MPI_LOCAL",
        "PLURIBUS_",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


def run_python(
    code: str, timeout: float = 60, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python (not an MPI job) and return the finished process."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        cwd=REPO,
    )


def run_mpiexec(
    ranks: int,
    script: str,
    tmp_path: Path,
    timeout: float = 60,
    genv: dict | None = None,
    args: list[str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``script`` (Python source) as an MPI job of ``ranks`` ranks."""
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    command = [mpiexec(), "-n", str(ranks)]
    for key, value in (genv or {}).items():
        command += ["-genv", key, value]
    command += [sys.executable, str(path)] + (args or [])
    return run_job(command, timeout)


def run_job(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``command`` in a session of its own; whatever is left of it is killed on return,
    and the shared-memory segments an aborted MPICH job leaves behind are removed."""
    segments_before = set(_mpich_segments())
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(**{JOB_VARIABLE: token}),
        cwd=REPO,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_job(token)
        out, err = proc.communicate()
        raise AssertionError(
            f"{command[:4]}... still running after {timeout:.0f}s; output:\n{out}\n{err}"
        ) from None
    finally:
        _kill_job(token)
        _remove_orphaned_segments(segments_before)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _mpich_segments() -> list[Path]:
    return list(Path("/dev/shm").glob("mpich_shm_*"))


def _remove_orphaned_segments(existing: set[Path]) -> None:
    """Unlink MPICH segments made since ``existing`` that no live process maps any more
    (MPI_Abort ends ranks before MPICH unlinks them)."""
    new = [p for p in _mpich_segments() if p not in existing]
    if not new:
        return
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(
                line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line
            )
        except OSError:
            continue
    for path in new:
        if str(path) not in mapped:
            path.unlink(missing_ok=True)


def _kill_job(token: str, seconds: float = 10.0) -> None:
    """Kill every process of the job that carries ``token`` in its environment, and wait until
    they are gone. mpiexec's proxy and the ranks each run in a session of their own, so
    neither the launcher's process group nor its session reaches them; and a killed rank still
    maps its MPICH segment until the kernel has torn it down, while an orphaned segment is only
    removed once nothing maps it."""
    deadline = time.monotonic() + seconds
    while True:
        alive = _job_members(token)
        if not alive or time.monotonic() > deadline:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def _job_members(token: str) -> list[int]:
    """The processes (zombies aside: they hold no memory) whose environment holds ``token``."""
    marker = f"{JOB_VARIABLE}={token}".encode()
    members = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker not in environ.read_bytes().split(b"\0"):
                continue
            state = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            members.append(int(environ.parent.name))
    return members
