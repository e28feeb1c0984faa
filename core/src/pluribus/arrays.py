"""Array helpers shared by the core and backends: device detection, checks, in-place reduction.

Works for numpy and cupy without importing cupy: a cupy array is recognised by its type's module,
and numpy's ufuncs dispatch to cupy through ``__array_ufunc__``.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import numpy as np

from .types import ReduceOp

_BASE_DTYPES = {
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.float16,
        np.float32,
        np.float64,
    )
}


@functools.cache
def bfloat16_dtype() -> np.dtype | None:
    """numpy's bfloat16 from ml_dtypes, or None when ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


@functools.cache
def supported_dtypes() -> frozenset[np.dtype]:
    found = set(_BASE_DTYPES)
    bf16 = bfloat16_dtype()
    if bf16 is not None:
        found.add(bf16)
    return frozenset(found)


def device_of(array: Any) -> str:
    """ "cuda" for a cupy array, "cpu" for anything numpy can see without a copy."""
    if type(array) is np.ndarray:
        return "cpu"
    module = type(array).__module__
    if module.startswith("cupy"):
        return "cuda"
    return "cpu"


def is_integer_like(dtype: np.dtype) -> bool:
    return dtype.kind in "biu"


@functools.cache
def _cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None


def check_cuda_array(array: Any, rank: int) -> None:
    """Refuse an object that looks like a cupy array (its type's module starts with "cupy") for
    a backend that carries cupy arrays, when cupy is not installed: the backend would fail in
    the middle of the call, after it may have sent something. A numpy subclass named like cupy
    (the test suites' stand-in for device arrays) is host memory, and passes."""
    if not isinstance(array, np.ndarray) and not _cupy_installed():
        raise TypeError(
            f"rank {rank}: the array is a {type(array).__module__}.{type(array).__name__}, which "
            "pluribus takes for a cupy array, but cupy is not installed here; pass a numpy "
            "array, or install cupy"
        )


@functools.cache
def _supported_dtype_ids() -> frozenset[int]:
    """The ids of the supported dtypes' own objects: a numpy array of a native-order builtin
    dtype carries one of these, and testing an id skips hashing the dtype (about 0.3 us)."""
    return frozenset(id(d) for d in supported_dtypes())


def check_array(array: Any, what: str, rank: int, writable: bool = True) -> None:
    """Refuse anything a backend cannot send in place, before anything is sent."""
    if type(array) is np.ndarray:  # the usual case, in three attribute reads
        flags = array.flags
        if (
            flags.c_contiguous
            and (flags.writeable or not writable)
            and id(array.dtype) in _supported_dtype_ids()
        ):
            return
    if not hasattr(array, "dtype") or not hasattr(array, "flags"):
        raise TypeError(
            f"rank {rank}: {what} must be a numpy or cupy array, got {type(array).__name__}"
        )
    if not isinstance(array, np.ndarray) and device_of(array) == "cpu":
        raise TypeError(
            f"rank {rank}: {what} must be a numpy or cupy array, got "
            f"{type(array).__module__}.{type(array).__name__}; convert it with np.asarray"
        )
    if not array.flags.c_contiguous:
        raise ValueError(
            f"rank {rank}: {what} is not contiguous (shape {array.shape}, strides "
            f"{array.strides}); pass np.ascontiguousarray(x) and copy the result back"
        )
    if writable and not getattr(array.flags, "writeable", True):  # cupy has no such flag
        raise ValueError(
            f"rank {rank}: {what} is read-only; collectives write their result in place, "
            "pass a writable copy"
        )
    if array.dtype not in supported_dtypes():
        hint = " (install ml_dtypes for bfloat16)" if "bfloat16" in str(array.dtype) else ""
        raise TypeError(
            f"rank {rank}: dtype {array.dtype} of {what} is not supported; use one of bool, "
            f"int8-int64, uint8, float16, float32, float64, bfloat16{hint}"
        )


def check_op(op: ReduceOp, dtype: Any, rank: int) -> None:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"rank {rank}: op must be a pluribus.ReduceOp, got {op!r}")
    dtype = np.dtype(dtype)
    if op.bitwise and not is_integer_like(dtype):
        raise TypeError(
            f"rank {rank}: ReduceOp.{op.name} needs an integer or bool array, got {dtype}"
        )
    if op is ReduceOp.AVG and is_integer_like(dtype):
        raise TypeError(
            f"rank {rank}: ReduceOp.AVG needs a floating-point array, got {dtype}; reduce with "
            "SUM and divide, or cast first"
        )


def reduce_ufunc(op: ReduceOp, dtype: np.dtype):
    """The numpy ufunc that combines two arrays of ``dtype`` for ``op`` (logical ones for bool)."""
    if dtype == np.bool_:
        table = {
            ReduceOp.SUM: np.logical_or,
            ReduceOp.PRODUCT: np.logical_and,
            ReduceOp.MIN: np.logical_and,
            ReduceOp.MAX: np.logical_or,
            ReduceOp.BAND: np.logical_and,
            ReduceOp.BOR: np.logical_or,
            ReduceOp.BXOR: np.logical_xor,
        }
        return table[op]
    return {
        ReduceOp.SUM: np.add,
        ReduceOp.AVG: np.add,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    }[op]


def reduce_into(dst: Any, src: Any, op: ReduceOp) -> None:
    """``dst = op(dst, src)`` in place, elementwise. AVG accumulates a sum (divide at the end)."""
    reduce_ufunc(op, np.dtype(dst.dtype))(dst, src, out=dst)


def finish_average(array: Any, op: ReduceOp, count: int) -> None:
    """Turn the sum accumulated for AVG into the mean."""
    if op is ReduceOp.AVG:
        array /= count


def flat(array: Any) -> Any:
    """A 1-D view of a contiguous array (no copy): the array itself when it already is one (a
    reshape costs 0.25-0.5 µs, and backends flatten every array of every call)."""
    return array if array.ndim == 1 else array.reshape(-1)


def byte_view(array: Any) -> Any:
    """The array's memory as a 1-D uint8 view (no copy)."""
    return flat(array).view(np.uint8)


def empty_like(array: Any) -> Any:
    """An uninitialised array like ``array`` on the same device."""
    if device_of(array) == "cuda":
        import cupy

        return cupy.empty_like(array)
    return np.empty_like(array)
