"""Test hygiene for the whole repository: MPICH's launcher (hydra) writes its topology to
``/tmp/hydra_hwloc_xmlfile_*`` and leaves the file behind when a job ends by MPI_Abort, as
several tests make jobs do on purpose. The files that appeared during a test session, and that
no process holds open any more, are removed when it ends."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

HYDRA_FILES = "/tmp/hydra_hwloc_xmlfile_*"


def _held_open() -> set[str]:
    """The paths some live process has open."""
    held = set()
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            held.add(os.readlink(fd))
        except OSError:
            continue
    return held


@pytest.fixture(scope="session", autouse=True)
def _no_hydra_leftovers():
    before = set(glob.glob(HYDRA_FILES))
    yield
    new = set(glob.glob(HYDRA_FILES)) - before
    if new:
        held = _held_open()
        for path in new - held:
            Path(path).unlink(missing_ok=True)
