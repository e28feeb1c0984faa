"""Is this process a rank of an MPI job, and which one? Answered from the launcher's environment
first (no MPI import), and from ``MPI.COMM_WORLD`` once MPI is loaded.

``setup_env()`` turns an MPI job into the environment ``init_process_group()`` reads (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so that any backend can start under mpiexec.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
from typing import Any

#: (rank, size) variables that MPI launchers set in every rank's environment.
LAUNCHER_VARIABLES = (
    ("PMI_RANK", "PMI_SIZE"),  # MPICH (hydra), Intel MPI, MVAPICH
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),  # MVAPICH2
    ("PMIX_RANK", "PMIX_SIZE"),  # PMIx launchers (srun --mpi=pmix, prterun)
)


def launcher_rank_size() -> tuple[int, int | None] | None:
    """(rank, size) from the MPI launcher's variables, or None when not started by one.

    ``size`` is None when the launcher sets only the rank (PMIx sets no size variable).
    """
    env = os.environ
    for rank_var, size_var in LAUNCHER_VARIABLES:
        if rank_var in env:
            try:
                rank = int(env[rank_var])
                size = int(env[size_var]) if size_var in env else None
            except ValueError:
                continue
            return rank, size
    return None


def in_mpi_job() -> bool:
    """True when an MPI launcher (mpiexec, mpirun, srun with PMI) started this process."""
    return launcher_rank_size() is not None


def mpiexec_path() -> str | None:
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH, else None."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else shutil.which("mpiexec")


def env_disagreement(rank: int, size: int) -> str | None:
    """What is wrong when RANK / WORLD_SIZE are set and disagree with MPI's rank and size."""
    for var, mpi_value, what in (("RANK", rank, "rank"), ("WORLD_SIZE", size, "size")):
        value = os.environ.get(var)
        if value is not None and value.strip() != str(mpi_value):
            return (
                f"rank {rank}: {var}={value} disagrees with MPI, whose {what} for this process is "
                f"{mpi_value} (mpiexec -n {size}); unset {var} and let MPI number the ranks, or "
                "start the job with pluribus-run and another backend (gloo) instead of mpiexec"
            )
    return None


def _node_local(MPI, comm) -> tuple[int, int]:
    """(local rank, ranks on this node) from a shared-memory split of ``comm``."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def setup_env(timeout: float | None = None) -> tuple[int, int]:
    """Fill in RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from
    the MPI job, so that a plain ``pluribus.init_process_group(...)`` works under mpiexec for any
    backend. Every rank must call it (it broadcasts rank 0's address). Returns (rank, size).

    Variables already set are kept, after checking that RANK and WORLD_SIZE agree with MPI.
    Like creating the backend, it installs the hook that ends the whole job (MPI_Abort) on an
    uncaught exception, unless PLURIBUS_MPI_ABORT_ON_ERROR=0.
    Rank 0 picks a free port and, when the job spans several nodes, its host's address; a random
    ``PLURIBUS_AUTH_TOKEN`` is shared too, so that only this job's ranks can use the store.
    """
    from .failure import abort_on_error_default, install_excepthook, raise_if_any
    from .probe import load_mpi

    MPI = load_mpi(initialize=True)
    if abort_on_error_default():
        install_excepthook()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    raise_if_any(comm, env_disagreement(rank, size), "set up the environment")
    local_rank, local_size = _node_local(MPI, comm)
    env = os.environ
    if rank == 0:
        host = env.get("MASTER_ADDR")
        if host is None:
            host = "127.0.0.1" if local_size == size else socket.gethostbyname(socket.gethostname())
        port = env.get("MASTER_PORT")
        if port is None:
            with socket.socket() as probe:
                probe.bind((host if local_size != size else "127.0.0.1", 0))
                port = str(probe.getsockname()[1])
        token = env.get("PLURIBUS_AUTH_TOKEN") or secrets.token_hex(16)
        shared = (host, port, token)
    else:
        shared = None
    # As bytes, not mpi4py's pickled bcast: nothing here unpickles what another process sent.
    host, port, token = _bcast_strings(comm, shared)
    env.setdefault("RANK", str(rank))
    env.setdefault("WORLD_SIZE", str(size))
    env.setdefault("LOCAL_RANK", str(local_rank))
    env.setdefault("LOCAL_WORLD_SIZE", str(local_size))
    env.setdefault("MASTER_ADDR", host)
    env.setdefault("MASTER_PORT", port)
    env.setdefault("PLURIBUS_AUTH_TOKEN", token)
    return rank, size


def mpi_rendezvous(
    init_method: str | None,
    rank: int | None,
    world_size: int | None,
    timeout: float,
    backends: Any = (),
) -> tuple[Any, int, int] | None:
    """The store, rank and world size of an MPI job, for ``init_process_group``; None when this
    process is not a rank of an MPI job, another init method was asked for, or no backend needs
    MPI and RANK, WORLD_SIZE and MASTER_PORT are all set.

    Explicit ``rank`` / ``world_size`` and RANK / WORLD_SIZE must agree with MPI. Rank 0 serves
    a TCPStore (address and port shared through MPI, see :func:`setup_env`), unless MASTER_ADDR
    and MASTER_PORT already name one.
    """
    if not in_mpi_job() or init_method not in (None, "env://"):
        return None
    names = set(backends.values()) if isinstance(backends, dict) else set(backends)
    launched = all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    if "mpi" not in names and launched:
        return None  # another backend, and the environment already says everything
    from pluribus import TCPStore

    from .probe import load_mpi

    MPI = load_mpi(initialize=True)
    from .failure import raise_if_any

    mpi_rank, mpi_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    problem = None
    for given, actual, what in ((rank, mpi_rank, "rank"), (world_size, mpi_size, "world_size")):
        if given is not None and given >= 0 and given != actual:
            problem = (
                f"rank {mpi_rank}: init_process_group({what}={given}) disagrees with MPI, "
                f"whose {what} for this process is {actual} (mpiexec -n {mpi_size}); leave it "
                "unset under mpiexec"
            )
    raise_if_any(MPI.COMM_WORLD, problem, "join the job")
    served = os.environ.get("PLURIBUS_STORE_SERVED") == "1"
    setup_env(timeout)
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=(mpi_rank == 0 and not served),
        timeout=timeout,
    )
    return store, mpi_rank, mpi_size


def _bcast_strings(comm: Any, strings: tuple[str, ...] | None) -> list[str]:
    """Rank 0's ``strings`` (no newlines in them) on every rank, through MPI buffers."""
    data = bytearray("\n".join(strings).encode()) if strings is not None else bytearray()
    length = bytearray(len(data).to_bytes(8, "little"))
    comm.Bcast(length, root=0)
    if strings is None:
        data = bytearray(int.from_bytes(length, "little"))
    comm.Bcast(data, root=0)
    return data.decode().split("\n")
