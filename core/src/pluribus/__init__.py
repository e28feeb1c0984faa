"""pluribus: distributed training for Python arrays, with backends as plugins.

``import pluribus`` loads no backend library; plugins are found on first use.
"""

from .backend import Backend
from .distributed import (
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object,
    destroy_process_group,
    gather,
    get_backend,
    get_default_group,
    get_rank,
    get_world_size,
    init_process_group,
    irecv,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    rendezvous,
    scatter,
    send,
)
from .errors import (
    AuthenticationError,
    BackendUnavailableError,
    CollectiveMismatchError,
    DistTimeoutError,
    NotInitializedError,
    PeerError,
    PluginError,
    PluribusError,
)
from .group import NON_GROUP_MEMBER, ProcessGroup
from .hookspecs import hookimpl
from .plugins import (
    availability,
    available_backends,
    get_plugin_manager,
    is_available,
)
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore
from .symmetric import empty_symmetric
from .types import Availability, BackendContext, BackendSpec, ReduceOp
from .work import Work

__version__ = "0.1.0"


def is_gloo_available() -> bool:
    """True when the gloo plugin is installed and can run here."""
    return is_available("gloo")


def is_mpi_available() -> bool:
    """True when the mpi plugin, mpi4py and an MPI library are installed."""
    return is_available("mpi")


def is_ucc_available() -> bool:
    """True when the ucc plugin, ucxx and UCX are installed."""
    return is_available("ucc")


def is_nccl_available() -> bool:
    """True when the nccl plugin, cupy, a CUDA device and NCCL are present."""
    return is_available("nccl")


__all__ = [
    "NON_GROUP_MEMBER",
    "AuthenticationError",
    "Availability",
    "Backend",
    "BackendContext",
    "BackendSpec",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "DistTimeoutError",
    "FileStore",
    "HashStore",
    "NotInitializedError",
    "PeerError",
    "PluginError",
    "PluribusError",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "availability",
    "available_backends",
    "barrier",
    "broadcast",
    "broadcast_object",
    "destroy_process_group",
    "empty_symmetric",
    "gather",
    "get_backend",
    "get_default_group",
    "get_plugin_manager",
    "get_rank",
    "get_world_size",
    "hookimpl",
    "init_process_group",
    "irecv",
    "is_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_ucc_available",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "rendezvous",
    "scatter",
    "send",
]
