"""MPI datatypes and reduction operations for numpy dtypes and pluribus ReduceOps.

Importing this module initialises MPI (``MPI_THREAD_MULTIPLE``), as every module of the backend
that imports it does; only ``create`` imports them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from pluribus import ReduceOp
from pluribus.arrays import bfloat16_dtype

from .probe import load_mpi

MPI = load_mpi(initialize=True)

_TYPES = {
    np.dtype(np.bool_): MPI.C_BOOL,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
}
_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVG: MPI.SUM,
    ReduceOp.PRODUCT: MPI.PROD,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.BAND: MPI.BAND,
    ReduceOp.BOR: MPI.BOR,
    ReduceOp.BXOR: MPI.BXOR,
}
# MPI's logical operations on C_BOOL, with the meaning the core gives each op on bool arrays.
_BOOL_OPS = {
    ReduceOp.SUM: MPI.LOR,
    ReduceOp.PRODUCT: MPI.LAND,
    ReduceOp.MIN: MPI.LAND,
    ReduceOp.MAX: MPI.LOR,
    ReduceOp.BAND: MPI.LAND,
    ReduceOp.BOR: MPI.LOR,
    ReduceOp.BXOR: MPI.LXOR,
}


class _HalfFloats:
    """float16 and bfloat16, which MPI has no types for: a private 2-byte datatype for each and
    user-defined MPI operations that reduce with numpy (made on first use)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.types: dict[np.dtype, Any] = {}
        self.ops: dict[ReduceOp, Any] = {}

    def _ensure(self) -> None:
        if self.types:
            return
        self.types[np.dtype(np.float16)] = MPI.UINT16_T.Dup().Commit()
        bf16 = bfloat16_dtype()
        if bf16 is not None:
            self.types[bf16] = MPI.UINT16_T.Dup().Commit()
        for op, ufunc in (
            (ReduceOp.SUM, np.add),
            (ReduceOp.PRODUCT, np.multiply),
            (ReduceOp.MIN, np.minimum),
            (ReduceOp.MAX, np.maximum),
        ):
            self.ops[op] = MPI.Op.Create(self._kernel(ufunc), commute=True)
        self.ops[ReduceOp.AVG] = self.ops[ReduceOp.SUM]

    def _kernel(self, ufunc: Callable) -> Callable:
        by_type = [(t, d) for d, t in self.types.items()]

        def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            for mpi_type, dtype in by_type:  # noqa: B007 (dtype is used after the loop)
                if datatype == mpi_type:
                    break
            else:  # pragma: no cover - the op is only ever used with these types
                raise TypeError(f"pluribus-mpi half-float op called on {datatype}")
            acc = np.frombuffer(inoutbuf, dtype=dtype)
            ufunc(acc, np.frombuffer(inbuf, dtype=dtype), out=acc)

        return reduce

    def type_and_op(self, dtype: np.dtype, op: ReduceOp) -> tuple[Any, Any]:
        with self.lock:
            self._ensure()
        return self.types[dtype], self.ops[op]


_half = _HalfFloats()


TYPE_AND_OP = {
    (dtype, op): (mpi_type, (_BOOL_OPS if mpi_type is MPI.C_BOOL else _OPS)[op])
    for dtype, mpi_type in _TYPES.items()
    for op in ReduceOp
    if op in (_BOOL_OPS if mpi_type is MPI.C_BOOL else _OPS)
}


def mpi_type_and_op(dtype: np.dtype, op: ReduceOp, array: Any = None) -> tuple[Any, Any]:
    """The MPI datatype and operation that reduce ``dtype`` arrays with ``op``."""
    found = TYPE_AND_OP.get((dtype, op))
    if found is not None:
        return found
    if array is not None and type(array).__module__.startswith("cupy"):
        raise TypeError(
            f"{dtype} reductions of cupy arrays are not supported on MPI (its half-float "
            "operations run on the host); reduce cupy arrays with NCCL (backend="
            '"cpu:mpi,cuda:nccl"), through host memory (PLURIBUS_GPU_STAGING=1 with '
            "PLURIBUS_MPI_CUDA_AWARE=0), or in float32"
        )
    return _half.type_and_op(dtype, op)
