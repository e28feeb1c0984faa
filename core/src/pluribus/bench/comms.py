"""One interface over pluribus, torch.distributed and mpi4py, so all three run the same benchmark.

A ``Comm`` hands out a zero-argument closure per collective with its buffers already bound, so the
timed loop measures the library call and nothing of ours. torch and mpi4py are imported only when
their Comm is created.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from ..types import ReduceOp
from .core import Case, array_module


class Comm:
    """The operations the benchmark needs from a communication library."""

    name = "comm"
    rank = 0
    size = 1
    #: The library and its version, for the report ("torch 2.13.0+cpu", "MPICH 5.0.2", ...).
    library = ""
    #: How the buffers are allocated, ``empty(count, dtype)``; None: the device's plain arrays.
    empty: Callable[[int, Any], Any] | None = None

    def unsupported(self, collective: str, dtype: np.dtype, op: ReduceOp) -> str | None:
        """Why this library cannot run ``collective`` on ``dtype`` with ``op``; None if it can."""
        return None

    def runner(self, collective: str, case: Case, op: ReduceOp, root: int) -> Callable[[], None]:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        buf = np.array([value], dtype=np.int64)
        self._broadcast_array(buf)
        return int(buf[0])

    def allgather_f64(self, values: np.ndarray) -> np.ndarray:
        """Every rank's equally long float64 ``values`` as a (size, len) array on every rank."""
        raise NotImplementedError

    def _broadcast_array(self, buf: np.ndarray) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _blocks(array: np.ndarray, parts: int) -> list[np.ndarray]:
    per = array.size // parts
    return [array[i * per : (i + 1) * per] for i in range(parts)]


class PluribusComm(Comm):
    """pluribus' public API on a group (the default group unless one is given).

    With ``direct=True`` it calls the backend's own methods (or the core's generic algorithm
    where the backend has none), skipping the argument checks, hooks and work queue of the
    public API: the difference between the two is the core's cost per call.
    """

    def __init__(
        self,
        group: Any = None,
        direct: bool = False,
        device: str = "cpu",
        name: str = "",
        symmetric: bool = False,
    ):
        import pluribus

        self.pl = pluribus
        self.group = group if group is not None else pluribus.get_default_group()
        self.rank = self.group.rank
        self.size = self.group.size
        self.direct = direct
        self.device = device
        if symmetric and device == "cpu":
            group = self.group
            self.empty = lambda count, dtype: pluribus.empty_symmetric(count, dtype, group)
        suffix = ("-direct" if direct else "") + ("-symmetric" if self.empty else "")
        self.name = name or f"pluribus-{self.group.backend_name}{suffix}"
        backend = self.group.backend_name
        version = pluribus.availability(backend).version if "," not in backend else ""
        self.library = f"pluribus {pluribus.__version__}, backend {backend} {version}".strip()

    def _global(self, local_rank: int) -> int:
        return self.group.ranks[local_rank]

    def unsupported(self, collective, dtype, op):
        from ..arrays import check_op, supported_dtypes

        if np.dtype(dtype) not in supported_dtypes():
            return f"dtype {dtype} is not supported by pluribus"
        if collective not in ("all_reduce", "reduce_scatter", "reduce"):
            return None
        try:
            check_op(op, dtype, self.group.global_rank)
        except TypeError as exc:
            return str(exc)
        backend = self.group.backend_for(array_module(self.device).empty(0, dtype))
        reason = backend.unsupported(np.dtype(dtype), op)
        return reason or None

    def runner(self, collective, case, op, root):
        if self.direct:
            return self._direct_runner(collective, case, op, root)
        pl, g = self.pl, self.group
        send, recv = case.send, case.recv
        root = self._global(root)
        if collective == "all_reduce":
            return lambda: pl.all_reduce(recv, op, group=g)
        if collective == "broadcast":
            return lambda: pl.broadcast(recv, root, group=g)
        if collective == "reduce":
            return lambda: pl.reduce(recv, root, op, group=g)
        if collective == "all_gather":
            return lambda: pl.all_gather(recv, send, group=g)
        if collective == "reduce_scatter":
            return lambda: pl.reduce_scatter(recv, send, op, group=g)
        if collective == "all_to_all":
            outputs, inputs = _blocks(recv, self.size), _blocks(send, self.size)
            return lambda: pl.all_to_all(outputs, inputs, group=g)
        raise ValueError(f"unknown collective {collective!r}")

    def _direct_runner(self, collective, case, op, root):
        from functools import partial

        from .. import algorithms

        backend = self.group.backend_for(case.recv)
        method = getattr(backend, collective, None) or partial(
            getattr(algorithms, collective), backend
        )
        send, recv, n = case.send, case.recv, self.size
        args = {
            "all_reduce": (recv, op),
            "broadcast": (recv, root),
            "reduce": (recv, root, op),
            "all_gather": (_blocks(recv, n), send),
            "reduce_scatter": (recv, _blocks(send, n), op),
            "all_to_all": (_blocks(recv, n), _blocks(send, n)),
        }[collective]
        return lambda: method(*args)

    def barrier(self):
        self.pl.barrier(group=self.group)

    def _broadcast_array(self, buf):
        self.pl.broadcast(buf, self._global(0), group=self.group)

    def allgather_f64(self, values):
        values = np.ascontiguousarray(values, dtype=np.float64)
        out = np.empty((self.size, values.size), dtype=np.float64)
        self.pl.all_gather(out, values, group=self.group)
        return out


class TorchComm(Comm):
    """torch.distributed with its gloo backend, on numpy buffers shared with torch tensors.

    torch has no AVG on gloo, so AVG is timed as SUM followed by the division, as a user would
    write it.
    """

    name = "torch-gloo"

    def __init__(self, rank: int, size: int, timeout: float = 300.0):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout),
        )
        self.rank, self.size = rank, size
        self.library = f"torch {torch.__version__} (gloo)"
        self.ops = {
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.AVG: dist.ReduceOp.SUM,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
            ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.BAND: dist.ReduceOp.BAND,
            ReduceOp.BOR: dist.ReduceOp.BOR,
            ReduceOp.BXOR: dist.ReduceOp.BXOR,
        }
        # torch 2.13 renamed the single-tensor variants; prefer the new names without warnings.
        self.gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.scatter_reduce = (
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        )

    def tensor(self, array: np.ndarray):
        if "bfloat16" in str(array.dtype):
            return self.torch.from_numpy(array.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(array)

    def unsupported(self, collective, dtype, op):
        if collective in ("all_reduce", "reduce_scatter", "reduce") and op not in self.ops:
            return f"op {op.name} has no torch.distributed equivalent"
        return None

    def runner(self, collective, case, op, root):
        dist, n = self.dist, self.size
        send, recv = self.tensor(case.send), self.tensor(case.recv)
        top = self.ops.get(op, dist.ReduceOp.SUM)
        average = op is ReduceOp.AVG
        out = case.recv
        if collective == "all_reduce":
            if average:
                return lambda: (dist.all_reduce(recv, top), np.divide(out, n, out=out))
            return lambda: dist.all_reduce(recv, top)
        if collective == "broadcast":
            return lambda: dist.broadcast(recv, root)
        if collective == "reduce":
            if average and self.rank == root:
                return lambda: (dist.reduce(recv, root, top), np.divide(out, n, out=out))
            return lambda: dist.reduce(recv, root, top)
        if collective == "all_gather":
            return lambda: self.gather_into(recv, send)
        if collective == "reduce_scatter":
            if average:
                return lambda: (self.scatter_reduce(recv, send, top), np.divide(out, n, out=out))
            return lambda: self.scatter_reduce(recv, send, top)
        if collective == "all_to_all":
            return lambda: dist.all_to_all_single(recv, send)
        raise ValueError(f"unknown collective {collective!r}")

    def barrier(self):
        self.dist.barrier()

    def _broadcast_array(self, buf):
        self.dist.broadcast(self.torch.from_numpy(buf), 0)

    def allgather_f64(self, values):
        values = np.ascontiguousarray(values, dtype=np.float64)
        out = np.empty((self.size, values.size), dtype=np.float64)
        self.gather_into(self.torch.from_numpy(out.reshape(-1)), self.torch.from_numpy(values))
        return out

    def close(self):
        self.dist.destroy_process_group()


class MpiComm(Comm):
    """Raw mpi4py on numpy buffers (the upper-case, buffer-based calls), in MPI.COMM_WORLD.

    MPI has no AVG, so AVG is timed as SUM followed by the division.
    """

    name = "mpi4py"

    def __init__(self):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        import mpi4py

        mpi_library = MPI.Get_library_version().strip().splitlines()[0]
        self.library = f"mpi4py {mpi4py.__version__}, {' '.join(mpi_library.split())}"
        self.ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.AVG: MPI.SUM,
            ReduceOp.PRODUCT: MPI.PROD,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.BAND: MPI.BAND,
            ReduceOp.BOR: MPI.BOR,
            ReduceOp.BXOR: MPI.BXOR,
        }

    def unsupported(self, collective, dtype, op):
        dtype = np.dtype(dtype)
        if dtype == np.float16 or "bfloat16" in str(dtype):
            return f"MPI has no standard datatype for {dtype}"
        if dtype == np.bool_ and collective in ("all_reduce", "reduce_scatter", "reduce"):
            return "MPI reductions on bool buffers are not portable"
        return None

    def runner(self, collective, case, op, root):
        MPI, comm, n = self.MPI, self.comm, self.size
        send, recv = case.send, case.recv
        mop = self.ops[op]
        average = op is ReduceOp.AVG
        if collective == "all_reduce":
            if average:
                return lambda: (
                    comm.Allreduce(MPI.IN_PLACE, recv, mop),
                    np.divide(recv, n, out=recv),
                )
            return lambda: comm.Allreduce(MPI.IN_PLACE, recv, mop)
        if collective == "broadcast":
            return lambda: comm.Bcast(recv, root)
        if collective == "reduce":
            if self.rank != root:
                return lambda: comm.Reduce(recv, None, mop, root)
            if average:
                return lambda: (
                    comm.Reduce(MPI.IN_PLACE, recv, mop, root),
                    np.divide(recv, n, out=recv),
                )
            return lambda: comm.Reduce(MPI.IN_PLACE, recv, mop, root)
        if collective == "all_gather":
            return lambda: comm.Allgather(send, recv)
        if collective == "reduce_scatter":
            if average:
                return lambda: (
                    comm.Reduce_scatter_block(send, recv, mop),
                    np.divide(recv, n, out=recv),
                )
            return lambda: comm.Reduce_scatter_block(send, recv, mop)
        if collective == "all_to_all":
            return lambda: comm.Alltoall(send, recv)
        raise ValueError(f"unknown collective {collective!r}")

    def barrier(self):
        self.comm.Barrier()

    def _broadcast_array(self, buf):
        self.comm.Bcast(buf, 0)

    def allgather_f64(self, values):
        values = np.ascontiguousarray(values, dtype=np.float64)
        out = np.empty((self.size, values.size), dtype=np.float64)
        self.comm.Allgather(values, out)
        return out
