"""Communication hooks: how DDP turns one bucket of local gradients into averaged ones.

A hook is ``hook(state, bucket) -> work``: it starts the communication for
``bucket.buffer()`` (a flat array of this rank's gradients) and returns something with
``wait()`` and ``result()``; ``result()`` is the averaged flat gradient, in any floating dtype
(DDP copies it back into the parameters' ``.grad``). ``state`` is what was registered with the
hook; for the built-in ones it is the process group (None for the default group). Hooks use only
the public collectives, so they work on every backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import distributed as dist
from ..arrays import bfloat16_dtype, device_of


class HookWork:
    """A collective's Work plus the array that holds the result once it completes."""

    def __init__(self, work: Any, value: Any, finish: Callable[[Any], Any] | None = None):
        self._work, self._value, self._finish = work, value, finish

    def wait(self, timeout: float | None = None) -> bool:
        if self._work is not None:
            self._work.wait(timeout)
            self._work = None
            if self._finish is not None:
                self._value = self._finish(self._value)
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def result(self) -> Any:
        self.wait()
        return self._value


def allreduce_hook(state: Any, bucket: Any) -> HookWork:
    """Divide by the group size, then sum across the group (torch's default)."""
    buffer = bucket.buffer()
    buffer /= dist.get_world_size(state)
    return HookWork(dist.all_reduce(buffer, group=state, async_op=True), buffer)


def _compressed(state: Any, bucket: Any, dtype: Any) -> HookWork:
    buffer = bucket.buffer()
    compressed = (buffer / dist.get_world_size(state)).astype(dtype)
    return HookWork(dist.all_reduce(compressed, group=state, async_op=True), compressed)


def fp16_compress_hook(state: Any, bucket: Any) -> HookWork:
    """Send gradients as float16: half the bytes; they are pre-divided so the sum cannot
    overflow. Relative error per element is about 2**-11 of its magnitude."""
    return _compressed(state, bucket, np.float16)


def bf16_compress_hook(state: Any, bucket: Any) -> HookWork:
    """Send gradients as bfloat16 (float32's range, 8 bits of mantissa); needs ml_dtypes and
    host arrays."""
    bf16 = bfloat16_dtype()
    if bf16 is None:
        raise ImportError("bf16_compress_hook needs ml_dtypes: pip install 'pluribus[bfloat16]'")
    if device_of(bucket.buffer()) != "cpu":
        raise TypeError(
            "bf16_compress_hook works on numpy gradients (ml_dtypes' bfloat16); use "
            "fp16_compress_hook for cupy arrays"
        )
    return _compressed(state, bucket, bf16)


BUILTIN_HOOKS = {
    "allreduce": allreduce_hook,
    "fp16": fp16_compress_hook,
    "bf16": bf16_compress_hook,
}
