"""Test hygiene for the whole repository: MPICH's launcher (hydra) writes its topology to
``/tmp/hydra_hwloc_xmlfile_*`` and leaves the file behind when a job ends by MPI_Abort, as
several tests make jobs do on purpose. When a test session ends and no MPICH job is running
anywhere on the machine (a live one may still read its file), the files this user's session
made are removed."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

HYDRA_FILES = "/tmp/hydra_hwloc_xmlfile_*"
HYDRA_PROCESSES = {"mpiexec", "mpiexec.hydra", "mpirun", "hydra_pmi_proxy"}


def _hydra_running() -> bool:
    """Whether an MPICH launcher or proxy runs (a zombie, a killed job's not yet reaped, does
    not: it reads no file)."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            name, rest = Path(stat).read_text().split("(", 1)[1].rsplit(")", 1)
        except (OSError, ValueError):
            continue
        if name in HYDRA_PROCESSES and rest.split()[0] != "Z":
            return True
    return False


@pytest.fixture(scope="session", autouse=True)
def _no_hydra_leftovers():
    before = set(glob.glob(HYDRA_FILES))
    yield
    new = set(glob.glob(HYDRA_FILES)) - before
    if not new or _hydra_running():
        return
    for path in new:
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
        except OSError:  # gone already, or not ours to remove
            continue
