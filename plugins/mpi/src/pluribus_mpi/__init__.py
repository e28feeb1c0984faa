"""pluribus-mpi: the ``mpi`` backend for pluribus, on MPI through mpi4py.

Start jobs with ``mpiexec -n N python train.py`` and ``pluribus.init_process_group("mpi")``.
Importing this package loads neither mpi4py nor an MPI library.
"""

from .env import in_mpi_job, launcher_rank_size, setup_env

__version__ = "0.1.0"

__all__ = ["__version__", "in_mpi_job", "launcher_rank_size", "setup_env"]
