"""Probing: is_mpi_available() is true only when mpi4py imports and an MPI library loads, the
reason names the missing part, and probing neither initialises MPI nor loads it at import."""

from __future__ import annotations

import time

import pytest
from mpi_test_support import clean_env, outside_mpi_job, run_python


@pytest.fixture(autouse=True)
def _fresh_processes():
    outside_mpi_job()


def test_available_with_the_library_named():
    result = run_python(
        """
        import pluribus
        status = pluribus.availability("mpi")
        print(pluribus.is_mpi_available(), status.version)
        print(sorted(status.details))
        """
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("True "), result.stderr
    assert "MPI" in lines[0]  # e.g. "MPICH Version: 5.0.2" or "Open MPI v5.0.5"
    assert "mpi4py" in lines[1] and "in_mpi_job" in lines[1]


def test_importing_the_plugin_loads_no_mpi_and_probing_keeps_mpi_out_of_this_process():
    start = time.monotonic()
    result = run_python(
        """
        import sys, time
        import pluribus, pluribus_mpi.plugin
        pluribus.get_plugin_manager()
        pluribus.plugins.backend_specs()
        assert "mpi4py" not in sys.modules, "mpi4py imported before probing"
        t = time.perf_counter()
        ok = pluribus.is_mpi_available()
        took = time.perf_counter() - t
        print(ok, "mpi4py.MPI" in sys.modules, f"{took:.3f}")
        """
    )
    ok, loaded, took = result.stdout.split()
    assert ok == "True", result.stderr
    # the library was loaded in a child: none is mapped here to shadow another backend's UCX
    assert loaded == "False", "probing outside an MPI job must not load MPI into this process"
    assert float(took) < 2.0
    assert time.monotonic() - start < 30


def test_missing_mpi4py_names_it_and_the_install_command():
    result = run_python(
        """
        import sys
        sys.modules["mpi4py"] = None  # as if it were not installed
        import pluribus
        from pluribus.plugins import resolve_backend
        status = pluribus.availability("mpi")
        print(status.ok)
        print(status.reason)
        print(status.remedy)
        try:
            resolve_backend("mpi")
        except pluribus.BackendUnavailableError as exc:
            print("error:", exc)
        """
    )
    ok, reason, remedy, error = result.stdout.splitlines()[:4]
    assert ok == "False", result.stderr
    assert reason.startswith("mpi4py is not installed")
    assert 'pip install "pluribus[mpi]" mpich' in remedy
    assert "mpi4py is not installed" in error and "pip install" in error


def test_missing_mpi_library_says_so_and_how_to_get_one():
    # mpi4py loads the library named by MPI4PY_LIBMPI: point it at one that does not exist
    result = run_python(
        """
        import pluribus
        status = pluribus.availability("mpi")
        print(status.ok)
        print(status.reason)
        print(status.remedy)
        """,
        env=clean_env() | {"MPI4PY_LIBMPI": "/nonexistent/libmpi.so.12"},
    )
    ok, reason, remedy = result.stdout.splitlines()[:3]
    assert ok == "False", result.stderr
    assert "mpi4py" in reason and "no MPI library could be loaded" in reason
    assert "libmpi.so.12" in reason
    assert "pip install mpich" in remedy


@pytest.mark.parametrize("value, expected", [("1", "True"), ("0", "False")])
def test_cuda_awareness_can_be_forced(value, expected):
    result = run_python(
        """
        from pluribus_mpi.probe import cuda_support
        print(*cuda_support())
        """,
        env=clean_env(PLURIBUS_MPI_CUDA_AWARE=value),
    )
    assert result.stdout.startswith(expected), result.stderr
    assert "PLURIBUS_MPI_CUDA_AWARE" in result.stdout


def test_cuda_awareness_is_asked_of_the_library():
    result = run_python(
        """
        import pluribus as pb
        pb.init_process_group("mpi", rank=0, world_size=1, store=pb.HashStore())
        backend = pb.get_default_group().backends["cpu"]
        print(backend.cuda_aware, backend.devices)
        print(backend.cuda_reason)
        """
    )
    aware, reason = result.stdout.splitlines()[:2]
    assert "MPIX_Query_cuda_support" in reason or "assuming not CUDA-aware" in reason, result
    if aware.startswith("False"):
        assert "('cpu',)" in aware
