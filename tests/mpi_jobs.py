"""MPI jobs for the repository-level tests: whether pytest is itself a rank of an mpiexec job
(the tests marked ``mpi`` run only then, one pytest process per rank), and the mpiexec that
tests starting their own job use."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:  # the mpi plugin knows what every MPI launcher sets, and where mpiexec is
    from pluribus_mpi.env import in_mpi_job as under_mpiexec
    from pluribus_mpi.env import mpiexec_path
except ImportError:  # not installed: no test here runs as, or starts, an MPI job

    def under_mpiexec() -> bool:
        return False

    def mpiexec_path() -> str | None:
        return None


def only_under_mpiexec(test_file: str) -> pytest.MarkDecorator:
    """Skip, saying how to run them, the tests of ``test_file`` outside an mpiexec job."""
    return pytest.mark.skipif(
        not under_mpiexec(),
        reason=f"not running under mpiexec (run: mpiexec -n 2 python "
        f"plugins/mpi/tests/pytest_rank.py -m mpi {test_file})",
    )


def mpiexec() -> str:
    """The mpiexec this job would use; skips the test when there is none."""
    found = mpiexec_path()
    if found is None:
        pytest.skip("no mpiexec: pip install mpich (or load your MPI module)")
    return found


def run_script(
    folder: Path, source: str, ranks: int, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """Run ``source`` as an MPI job of ``ranks`` in a session of its own (so that nothing
    outlives the test), with this environment less pluribus' and MPI's settings, plus ``env``;
    skips when this pytest is itself a rank."""
    if under_mpiexec():
        pytest.skip("starts its own MPI job")
    script = folder / "mpi_job.py"
    script.write_text(textwrap.dedent(source))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PLURIBUS_", "PMI_"))}
    return subprocess.run(
        [mpiexec(), "-n", str(ranks), sys.executable, str(script)],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=timeout,
        start_new_session=True,
    )
