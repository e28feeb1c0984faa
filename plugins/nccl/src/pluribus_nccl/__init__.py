"""pluribus-nccl: the NCCL backend for pluribus (GPU collectives on cupy arrays).

Importing this package imports no cupy; the backend loads it when probed or created.
"""

from .backend import NcclBackend, NcclWork
from .runtime import probe

__version__ = "0.1.0"

__all__ = ["NcclBackend", "NcclWork", "probe"]
