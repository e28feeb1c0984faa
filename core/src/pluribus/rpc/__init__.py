"""Remote calls and remote references between named workers, safe by construction.

torch.distributed.rpc's API (``init_rpc``, ``rpc_sync``, ``rpc_async``, ``remote``, ``RRef``,
``shutdown``) without its pickles: a worker runs only what it registered with ``@expose``, and
arguments and results are arrays (raw frames), RRefs and JSON-like values. Connections are
authenticated with the job's secret before any byte is parsed. See docs/rpc.md.
"""

from .agent import WorkerInfo
from .api import get_worker_info, init_rpc, remote, rpc_async, rpc_sync, shutdown
from .errors import RemoteError
from .futures import Future
from .registry import expose
from .rref import RRef

__all__ = [
    "Future",
    "RRef",
    "RemoteError",
    "WorkerInfo",
    "expose",
    "get_worker_info",
    "init_rpc",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
