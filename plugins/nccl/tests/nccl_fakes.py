"""A CPU stand-in for cupy and cupy.cuda.nccl, so the NCCL backend's logic runs without a GPU.

Ranks are threads of one process. "Device" arrays are numpy arrays of a subclass whose type
lives in a module named ``cupy...``, which is what ``pluribus.arrays.device_of`` calls a cuda
array. The fake communicator reads and writes the raw addresses the backend passes to NCCL, so
a wrong pointer, count, datatype or root gives a wrong result, as it would on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import numpy as np


class FakeCupyArray(np.ndarray):
    """A numpy array that pluribus takes for a cupy array (its type's module starts "cupy")."""


FakeCupyArray.__module__ = "cupy_fake"


def device_array(values: Any, dtype: Any = None) -> FakeCupyArray:
    return np.ascontiguousarray(np.asarray(values, dtype=dtype)).view(FakeCupyArray)


# -- cupy.cuda.nccl ------------------------------------------------------------------------------

_TYPES = {
    0: np.int8,
    1: np.uint8,
    2: np.int32,
    3: np.uint32,
    4: np.int64,
    5: np.uint64,
    6: np.float16,
    7: np.float32,
    8: np.float64,
}
_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: "avg"}


class FakeNcclError(RuntimeError):
    pass


def _memory(pointer: int, count: int, datatype: int) -> np.ndarray:
    dtype = np.dtype(_TYPES[datatype])
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(pointer)
    return np.ctypeslib.as_array(raw).view(dtype)


class _Clique:
    """What the ranks of one communicator share: joins, collective rounds, mailboxes."""

    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.joined = 0
        self.rounds: dict[int, dict[int, Any]] = defaultdict(dict)
        self.mailboxes: dict[tuple[int, int], deque] = defaultdict(deque)


class FakeNccl:
    """The module ``cupy.cuda.nccl`` as far as the backend uses it."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32 = 0, 1, 2, 3
    NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 4, 5, 6, 7, 8
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

    def __init__(self, id_form: str = "bytes", version: int = 22103, wait: float = 10.0):
        self.id_form = id_form  # "bytes" like cupy 14, "tuple" like cupy 13
        self.version = version
        self.wait = wait
        self.cliques: dict[bytes, _Clique] = {}
        self.lock = threading.Lock()
        self.unique_ids_made = 0
        self.local = threading.local()
        self.communicators: list[FakeCommunicator] = []
        outer = self

        class NcclCommunicator(FakeCommunicator):
            def __init__(self, ndev: int, comm_id: Any, rank: int):
                super().__init__(outer, ndev, comm_id, rank)

        self.NcclCommunicator = NcclCommunicator

    def get_version(self) -> int:
        return self.version

    def get_unique_id(self) -> Any:
        with self.lock:
            self.unique_ids_made += 1
        raw = os.urandom(128)
        if self.id_form == "bytes":
            return raw
        return tuple(b - 256 if b > 127 else b for b in raw)

    def groupStart(self) -> None:  # noqa: N802 - cupy's name
        self.local.depth = getattr(self.local, "depth", 0) + 1
        if self.local.depth == 1:
            self.local.queued = []

    def groupEnd(self) -> None:  # noqa: N802 - cupy's name
        self.local.depth -= 1
        if self.local.depth:
            return
        queued, self.local.queued = self.local.queued, []
        # Sends are buffered, so running them first lets every grouped receive complete.
        for comm, name, args in sorted(queued, key=lambda item: item[1] != "send"):
            getattr(comm, "_" + name)(*args)

    def in_group(self) -> bool:
        return getattr(self.local, "depth", 0) > 0


class FakeCommunicator:
    def __init__(self, nccl: FakeNccl, ndev: int, comm_id: Any, rank: int):
        expected = bytes if nccl.id_form == "bytes" else tuple
        if not isinstance(comm_id, expected):
            raise TypeError(
                f"Argument 'commId' has incorrect type (expected {expected.__name__}, "
                f"got {type(comm_id).__name__})"
            )
        key = bytes(v & 0xFF for v in comm_id) if expected is tuple else comm_id
        self.nccl = nccl
        self.size = ndev
        self.rank = rank
        self.key = key
        self.calls: list[tuple] = []
        self.aborted = False
        self.destroyed = False
        self.async_error: str | None = None
        self.seq = 0
        with nccl.lock:
            self.clique = nccl.cliques.setdefault(key, _Clique(ndev))
            nccl.communicators.append(self)
        with self.clique.cond:  # ncclCommInitRank returns once every rank has joined
            self.clique.joined += 1
            self.clique.cond.notify_all()
            if not self.clique.cond.wait_for(lambda: self.clique.joined >= ndev, nccl.wait):
                raise FakeNcclError(f"rank {rank}: not every rank joined")

    # Every NCCL call is recorded, then run now or, inside groupStart/groupEnd, at groupEnd.
    def __getattr__(self, name: str) -> Callable[..., None]:
        if name in (
            "allReduce",
            "reduce",
            "broadcast",
            "allGather",
            "reduceScatter",
            "send",
            "recv",
        ):

            def call(*args: Any) -> None:
                if self.aborted or self.destroyed:
                    raise FakeNcclError("communicator was aborted or destroyed")
                self.calls.append((name, *args))
                if self.nccl.in_group():
                    self.nccl.local.queued.append((self, name, args))
                else:
                    getattr(self, "_" + name)(*args)

            return call
        raise AttributeError(name)

    def check_async_error(self) -> None:
        if self.async_error:
            raise FakeNcclError(self.async_error)

    def abort(self) -> None:
        """Like ncclCommAbort: calls blocked on this communicator return with an error."""
        with self.clique.cond:
            self.aborted = True
            self.clique.cond.notify_all()

    def destroy(self) -> None:
        self.destroyed = True

    # -- semantics --------------------------------------------------------------------------------
    def _exchange(self, payload: Any) -> dict[int, Any]:
        seq, self.seq = self.seq, self.seq + 1
        clique = self.clique
        with clique.cond:
            clique.rounds[seq][self.rank] = payload
            clique.cond.notify_all()
            ok = clique.cond.wait_for(
                lambda: self.aborted or len(clique.rounds[seq]) >= self.size, self.nccl.wait
            )
            if self.aborted:
                raise FakeNcclError(f"rank {self.rank}: communicator aborted")
            if not ok:
                raise FakeNcclError(f"rank {self.rank}: collective {seq} incomplete")
            return dict(clique.rounds[seq])

    def _reduce_all(self, parts: list[np.ndarray], op: int) -> np.ndarray:
        result = parts[0].copy()
        ufunc = np.add if _OPS[op] == "avg" else _OPS[op]
        for part in parts[1:]:
            ufunc(result, part, out=result)
        if _OPS[op] == "avg":
            result /= self.size
        return result

    def _allReduce(self, send, recv, count, datatype, op, stream):  # noqa: N802
        parts = self._exchange(_memory(send, count, datatype).copy())
        _memory(recv, count, datatype)[...] = self._reduce_all(
            [parts[r] for r in range(self.size)], op
        )

    def _reduce(self, send, recv, count, datatype, op, root, stream):
        parts = self._exchange(_memory(send, count, datatype).copy())
        if self.rank == root:
            _memory(recv, count, datatype)[...] = self._reduce_all(
                [parts[r] for r in range(self.size)], op
            )

    def _broadcast(self, send, recv, count, datatype, root, stream):
        mine = _memory(send, count, datatype).copy() if self.rank == root else None
        parts = self._exchange(mine)
        _memory(recv, count, datatype)[...] = parts[root]

    def _allGather(self, send, recv, count, datatype, stream):  # noqa: N802
        parts = self._exchange(_memory(send, count, datatype).copy())
        _memory(recv, count * self.size, datatype)[...] = np.concatenate(
            [parts[r] for r in range(self.size)]
        )

    def _reduceScatter(self, send, recv, count, datatype, op, stream):  # noqa: N802
        parts = self._exchange(_memory(send, count * self.size, datatype).copy())
        total = self._reduce_all([parts[r] for r in range(self.size)], op)
        _memory(recv, count, datatype)[...] = total[self.rank * count : (self.rank + 1) * count]

    def _send(self, buf, count, datatype, peer, stream):
        clique = self.clique
        with clique.cond:
            clique.mailboxes[(self.rank, peer)].append(_memory(buf, count, datatype).copy())
            clique.cond.notify_all()

    def _recv(self, buf, count, datatype, peer, stream):
        clique = self.clique
        box = clique.mailboxes[(peer, self.rank)]
        with clique.cond:
            if not clique.cond.wait_for(lambda: box, self.nccl.wait):
                raise FakeNcclError(f"rank {self.rank}: nothing from {peer}")
            data = box.popleft()
        if data.size != count:
            raise FakeNcclError(f"rank {self.rank}: {peer} sent {data.size}, expected {count}")
        _memory(buf, count, datatype)[...] = data


# -- cupy ----------------------------------------------------------------------------------------


class FakeEvent:
    def __init__(self, runtime: FakeRuntime):
        self.runtime = runtime
        self.recorded_on: Any = None

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream

    @property
    def done(self) -> bool:
        return not self.runtime.events_hang


class FakeStream:
    def __init__(self, runtime: FakeRuntime, name: str):
        self.runtime = runtime
        self.name = name
        self.ptr = id(self)
        self.waited_on: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited_on.append(event)

    def __enter__(self) -> FakeStream:
        self.runtime.local.stack = [*self.runtime._stack(), self]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runtime.local.stack = self.runtime._stack()[:-1]


class FakeRuntime:
    """Stands in for :class:`pluribus_nccl.runtime.CupyRuntime`."""

    def __init__(self, nccl: FakeNccl | None = None, devices: int = 1):
        self.nccl = nccl or FakeNccl()
        self.devices = devices
        self.events_hang = False
        self.local = threading.local()
        self.default_streams: dict[int, FakeStream] = {}
        self.lock = threading.Lock()

    def _stack(self) -> list[FakeStream]:
        return getattr(self.local, "stack", [])

    def nccl_version(self) -> int:
        return self.nccl.get_version()

    def device_count(self) -> int:
        return self.devices

    def device(self, device_id: int):
        return contextlib.nullcontext()

    def device_identity(self, device_id: int) -> str:
        return f"testhost 0000:{device_id:02x}:00.0"

    def use_device(self, device_id: int) -> None:
        self.local.device = device_id

    def new_stream(self) -> FakeStream:
        return FakeStream(self, "communication")

    def current_stream(self) -> FakeStream:
        stack = self._stack()
        if stack:
            return stack[-1]
        with self.lock:  # one default stream per caller thread
            key = threading.get_ident()
            if key not in self.default_streams:
                self.default_streams[key] = FakeStream(self, "default")
            return self.default_streams[key]

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    def pointer(self, array: Any) -> int:
        return int(array.ctypes.data)

    def device_of(self, array: Any) -> int:
        return getattr(self.local, "device", 0)

    def empty(self, count: int, dtype: Any) -> FakeCupyArray:
        return np.empty(count, dtype=dtype).view(FakeCupyArray)

    def zeros(self, count: int, dtype: Any) -> FakeCupyArray:
        return np.zeros(count, dtype=dtype).view(FakeCupyArray)


# -- running ranks as threads --------------------------------------------------------------------


def run_threads(size: int, fn: Callable[[int], Any], timeout: float = 30.0) -> list[Any]:
    """Run ``fn(rank)`` on ``size`` threads; return the results in rank order, or raise the
    first rank's error."""
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # reported below
            errors.append((rank, exc))

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks still running after {timeout}s")
    if errors:
        rank, error = sorted(errors, key=lambda item: item[0])[0]
        raise AssertionError(f"rank {rank} failed: {type(error).__name__}: {error}") from error
    return results
