"""The MPI backend: each collective is one non-blocking MPI buffer operation on a communicator.

Importing this module initialises MPI (``MPI_THREAD_MULTIPLE``), so only ``create`` imports it.

Every operation starts the non-blocking form (``Iallreduce``, ``Ibcast``, ...) on arrays handed
to MPI in place (no pickling, no copies), and a :class:`MPIWork` wraps the request. Waiting
polls the request with ``Test``: spinning for about as long as the transfer should take, then
sleeping with a growing back-off, so that a rank waiting for a late peer leaves its CPU to the
others and every wait has a timeout (MPI itself has none). A blocking call is the same start
followed by a wait.

MPI matches collectives on a communicator in the order they are started, so starting them on the
calling thread, under a lock, keeps every group's operations in issue order.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from pluribus import Backend, ReduceOp
from pluribus.arrays import bfloat16_dtype, device_of
from pluribus.errors import DistTimeoutError, PluribusError
from pluribus.operations import OPERATIONS
from pluribus.work import Work

from .env import env_disagreement
from .probe import cuda_support, load_mpi

MPI = load_mpi(initialize=True)

#: A wait spins on ``Test`` for about as long as the transfer itself should take (MPI makes
#: progress only inside MPI calls, as its own blocking calls do by spinning), at least
#: ``SPIN_MIN_SECONDS`` and at most ``SPIN_MAX_SECONDS``; only then does it sleep between tests.
SPIN_MIN_SECONDS = float(os.environ.get("PLURIBUS_MPI_SPIN_US", "1000")) * 1e-6
SPIN_MAX_SECONDS = 0.05
SPIN_SECONDS_PER_BYTE = 2e-9  # 0.5 GB/s: slow enough for a loaded node
#: While spinning, yield the CPU every this many tests (cheap when no other thread wants it).
YIELD_EVERY = 64
#: Sleeps between ``Test`` calls grow to at most this, and to at most 1/16 of the time waited.
MAX_SLEEP_SECONDS = 1e-3
#: ``PLURIBUS_MPI_ABORT_ON_ERROR=0`` keeps the default ``sys.excepthook`` (no MPI_Abort).
ABORT_ENV = "PLURIBUS_MPI_ABORT_ON_ERROR"

# -- datatypes and reduction operations ------------------------------------------------------------

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


_TYPE_AND_OP = {
    (dtype, op): (mpi_type, (_BOOL_OPS if mpi_type is MPI.C_BOOL else _OPS)[op])
    for dtype, mpi_type in _TYPES.items()
    for op in ReduceOp
    if op in (_BOOL_OPS if mpi_type is MPI.C_BOOL else _OPS)
}


def mpi_type_and_op(dtype: np.dtype, op: ReduceOp, array: Any = None) -> tuple[Any, Any]:
    """The MPI datatype and operation that reduce ``dtype`` arrays with ``op``."""
    found = _TYPE_AND_OP.get((dtype, op))
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


# -- memory ---------------------------------------------------------------------------------------


def _address(array: Any) -> int:
    if device_of(array) == "cuda":
        return int(array.data.ptr)
    return array.__array_interface__["data"][0]


def _span(arrays: list[Any]) -> tuple[Any, list[int], list[int], bool]:
    """One MPI buffer covering ``arrays``: (buffer, byte counts, byte displacements, regular).

    The buffer starts at the lowest array and ends after the highest; MPI touches only the
    counted bytes at each displacement, so separate arrays need no staging copy. ``regular`` is
    true when the arrays are equal, consecutive blocks of one buffer (for Allgather, Alltoall).
    """
    addresses = [_address(a) for a in arrays]
    counts = [int(a.nbytes) for a in arrays]
    low = min(addresses)
    high = max(a + n for a, n in zip(addresses, counts, strict=True))
    displacements = [a - low for a in addresses]
    first = counts[0]
    regular = all(n == first for n in counts) and all(
        d == i * first for i, d in enumerate(displacements)
    )
    return MPI.buffer.fromaddress(low, high - low), counts, displacements, regular


def _overlaps(array: Any, buffer_low: int, buffer_bytes: int) -> bool:
    low = _address(array)
    return low < buffer_low + buffer_bytes and buffer_low < low + array.nbytes


def _byte_address(buffer: Any) -> int:
    return buffer.address


def _same_memory(a: Any, b: Any) -> bool:
    return _address(a) == _address(b) and a.nbytes == b.nbytes


def _compact(arrays: list[Any]) -> Any:
    """The arrays' bytes, concatenated into one new host or device buffer (a staging copy)."""
    if arrays and device_of(arrays[0]) == "cuda":
        import cupy

        return cupy.concatenate([a.reshape(-1).view(cupy.uint8) for a in arrays])
    if not arrays:
        return np.zeros(0, np.uint8)
    return np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])


def _sync_device(*arrays: Any) -> None:
    """MPI reads device memory directly: finish the kernels that write these arrays first."""
    for a in arrays:
        if a is not None and device_of(a) == "cuda":
            import cupy

            cupy.cuda.get_current_stream().synchronize()
            return


# -- work -----------------------------------------------------------------------------------------


class _Pending:
    """A request in flight, the callbacks that finish the operation, and the arrays it uses."""

    __slots__ = ("request", "status", "finishers", "keep")

    def __init__(self, request: Any, keep: tuple = (), status: Any = None):
        self.request = request
        self.status = status
        self.finishers: list[Callable[[], None]] = []
        self.keep = keep


class MPIWork(Work):
    """A Work around MPI requests. ``wait(timeout)`` polls them and raises DistTimeoutError."""

    def __init__(self, backend: MPIBackend, pending: _Pending, name: str, key_array: Any = None):
        self.backend = backend
        self.pending = pending
        self.name = name
        self.key_array = key_array
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[MPIWork], None]] = []

    @property
    def description(self) -> str:
        return _describe(self.name, self.key_array, self.backend.group_name)

    def _finish(self, error: BaseException | None = None) -> None:
        if error is None:
            try:
                for finish in self.pending.finishers:
                    finish()
            except BaseException as exc:
                error = exc
        self._error = error
        self._done = True
        self.pending.keep = ()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def add_done_callback(self, callback: Callable[[MPIWork], None]) -> None:
        """Call ``callback(work)`` when a wait or test sees the work finish (at once if it has).

        MPI completes requests only inside MPI calls, so this runs in the thread that waits.
        """
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def _poll(self) -> bool:
        """Test once; True when finished (successfully or not)."""
        if self._done:
            return True
        try:
            done = self.pending.request.Test(self.pending.status)
        except MPI.Exception as exc:
            self._finish(self.backend.translate(exc, self.description))
            return True
        if done:
            self._finish()
        return done

    def wait(self, timeout: float | None = None) -> bool:
        limit = self.backend.timeout if timeout is None else float(timeout)
        with self._lock:
            if not self._poll():
                self._wait_polling(limit)
        if self._error is not None:
            raise self._error
        return True

    def _wait_polling(self, limit: float) -> None:
        start = time.monotonic()
        nbytes = getattr(self.key_array, "nbytes", 0)
        spin = min(SPIN_MIN_SECONDS + nbytes * SPIN_SECONDS_PER_BYTE, SPIN_MAX_SECONDS, limit)
        spin_until = start + spin
        polls = 0
        while time.monotonic() < spin_until:
            if self._poll():
                return
            polls += 1
            if polls % YIELD_EVERY == 0:
                os.sched_yield()  # let a rank sharing this core run (oversubscribed jobs)
        deadline = start + limit
        delay = 50e-6
        while not self._poll():
            now = time.monotonic()
            if self.backend.aborted is not None:
                raise PluribusError(
                    f"rank {self.backend.rank}: {self.description} was stopped because "
                    f"{self.backend.aborted}"
                )
            if now >= deadline:
                raise DistTimeoutError(
                    f"rank {self.backend.rank}: {self.description} did not complete within "
                    f"{limit:.1f}s: another rank of the group has not started the same "
                    "operation (or died). The operation stays posted: wait again to let it "
                    "finish; MPI cannot cancel a collective, so if it never will, end the job "
                    "(an uncaught exception aborts every rank)"
                )
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, MAX_SLEEP_SECONDS, max(50e-6, (now - start) / 16))

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._poll()
        finally:
            self._lock.release()

    def exception(self) -> BaseException | None:
        return self._error if self.is_completed() else None

    def result(self) -> Any:
        self.wait()
        return None


# -- the backend ----------------------------------------------------------------------------------


class MPIBackend(Backend):
    """One rank's endpoint on an MPI communicator (a duplicate of COMM_WORLD for the world group,
    one made with ``Comm.Create_group`` for each sub-group)."""

    name = "mpi"
    detects_failures = True  # its own dead-peer detection and timeouts

    def __init__(
        self,
        comm: Any,
        timeout: float,
        cuda_aware: bool,
        group_name: str = "world",
        owns_comm: bool = True,
    ):
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout)
        self.comm = comm
        self.group_name = group_name
        self.owns_comm = owns_comm
        self.cuda_aware = cuda_aware
        self.devices = ("cpu", "cuda") if cuda_aware else ("cpu",)
        self.aborted: str | None = None
        self.closed = False
        self.subgroups: list[MPIBackend] = []
        # MPI_THREAD_MULTIPLE allows concurrent calls, but collectives on one communicator must
        # be started in the same order on every rank: they are started under this lock.
        self.start_lock = threading.Lock()
        # Synchronous all-reduce, broadcast and barrier on host arrays use MPI's blocking calls
        # (as fast as raw mpi4py: MPICH's non-blocking collectives take slower algorithms), with
        # a watchdog that ends the job when one outlives the timeout. Only when an error may end
        # the job anyway; otherwise every call polls a request and raises DistTimeoutError.
        self.blocking = abort_on_error_default()
        # (operation, key array) of the blocking call running now: a new tuple for every call, so
        # the watchdog tells calls apart by identity and no clock is read on the fast path
        self._watched: tuple[str, Any] | None = None
        self._watchdog: threading.Thread | None = None
        self._starters = {
            name[len("_start_") :]: getattr(self, name)
            for name in dir(self)
            if name.startswith("_start_")
        }
        if self.blocking:
            self.all_reduce = self._fast_all_reduce(self.all_reduce)

    def __repr__(self) -> str:
        return f"MPIBackend(rank={self.rank}, size={self.size})"

    # -- running ----------------------------------------------------------------------------------

    def translate(self, exc: BaseException, description: str) -> BaseException:
        """An MPI error as a pluribus error that says what happened on which rank."""
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_TRUNCATE:
            return ValueError(
                f"rank {self.rank}: {description}: the message received is larger than the "
                "array given to receive it; the ranks passed arrays of different sizes"
            )
        return PluribusError(f"rank {self.rank}: {description} failed in MPI: {exc}")

    def _check_open(self, description: str) -> None:
        if self.closed:
            raise PluribusError(f"rank {self.rank}: {description}: the MPI group was destroyed")
        if self.aborted is not None:
            raise PluribusError(
                f"rank {self.rank}: {description} refused: this rank's MPI backend was stopped "
                f"because {self.aborted}"
            )

    def start(self, name: str, args: tuple) -> MPIWork:
        """Start operation ``name`` as a non-blocking MPI call and return its Work (the core
        calls this for ``async_op=True``)."""
        key_array = OPERATIONS[name].key_array(args)
        return MPIWork(self, self._begin(name, args, key_array), name, key_array)

    def execute(self, name: str, args: tuple) -> None:
        """Start operation ``name`` and wait for it (the blocking form): one MPI blocking call
        under the watchdog where :attr:`blocking` allows it, else a request polled to the
        timeout. An operation complete at the first test finishes here, without a Work."""
        key_array = OPERATIONS[name].key_array(args)
        if (
            self.blocking
            and name in _BLOCKING_CALLS
            and (key_array is None or type(key_array).__module__ == "numpy")
            and not self.closed
            and self.aborted is None
        ):
            self._run_blocking(name, getattr(self, f"_blocking_{name}"), args, key_array)
            return
        pending = self._begin(name, args, key_array)
        try:
            done = pending.request.Test(pending.status)
        except MPI.Exception as exc:
            raise self.translate(exc, _describe(name, key_array, self.group_name)) from exc
        if not done:
            MPIWork(self, pending, name, key_array).wait()
            return
        for finish in pending.finishers:
            finish()

    def _fast_all_reduce(self, general: Any) -> Any:
        """The synchronous all-reduce with nothing between the caller and ``MPI_Allreduce`` but
        arming the watchdog: the call users time against raw mpi4py, and what the core calls
        as this backend's ``all_reduce``. AVG, half floats, cupy arrays and a stopped backend
        take ``general``."""
        comm, in_place, ndarray = self.comm, MPI.IN_PLACE, np.ndarray
        acquire, release = self.start_lock.acquire, self.start_lock.release
        # Keyed by id(op): ReduceOp members live for good, and Enum's hash is slow.
        types_and_ops = {
            (dtype, id(op)): found
            for (dtype, op), found in _TYPE_AND_OP.items()
            if op is not ReduceOp.AVG
        }
        last = (None, None, None)  # dtype, op, MPI type and op of the previous call: one store
        if self._watchdog is None:
            self._start_watchdog()

        def all_reduce(array: Any, op: ReduceOp) -> None:
            nonlocal last
            previous = last
            if array.dtype is previous[0] and op is previous[1]:
                found = previous[2]
            else:
                found = types_and_ops.get((array.dtype, id(op)))
                last = (array.dtype, op, found)
            if (
                found is None
                or type(array) is not ndarray
                or self.aborted is not None
                or self.closed
            ):
                return general(array, op)
            acquire()
            try:
                self._watched = ("all_reduce", array)
                comm.Allreduce(in_place, [array, found[0]], found[1])
            except MPI.Exception as exc:
                description = _describe("all_reduce", array, self.group_name)
                raise self.translate(exc, description) from exc
            finally:
                self._watched = None
                release()

        return all_reduce

    def _blocking_all_reduce(self, array: Any, op: ReduceOp) -> None:
        mpi_type, mpi_op = mpi_type_and_op(array.dtype, op, array)
        self.comm.Allreduce(MPI.IN_PLACE, [array, mpi_type], mpi_op)
        if op is ReduceOp.AVG and self.size > 1:
            _averager(array, self.size)()

    def _blocking_broadcast(self, array: Any, src: int) -> None:
        self.comm.Bcast([array, MPI.BYTE], src)

    def _blocking_barrier(self) -> None:
        self.comm.Barrier()

    def _run_blocking(self, name: str, blocking: Any, args: tuple, key_array: Any) -> None:
        """Run ``blocking(*args)``, one blocking MPI call, under the watchdog."""
        with self.start_lock:
            # Arming the watchdog is cheap: the description is made only on expiry.
            self._watched = (name, key_array)
            if self._watchdog is None:
                self._start_watchdog()
            try:
                blocking(*args)
            except MPI.Exception as exc:
                description = _describe(name, key_array, self.group_name)
                raise self.translate(exc, description) from exc
            except TypeError as exc:  # a dtype MPI cannot carry here; nothing was started
                raise TypeError(f"rank {self.rank}: {exc}") from exc
            finally:
                self._watched = None

    def _start_watchdog(self) -> None:
        self._watchdog = threading.Thread(
            target=self._watch_loop, name=f"pluribus-mpi-watchdog-{self.rank}", daemon=True
        )
        self._watchdog.start()

    def _watch_loop(self) -> None:
        """End the job when one blocking call has run for the timeout (give or take a period:
        a call is timed from when the watchdog first sees it)."""
        seen, since = None, 0.0
        while not self.closed:
            time.sleep(WATCHDOG_PERIOD)
            watched = self._watched
            if watched is not seen:  # no call, or another one: ``seen`` keeps it alive
                seen, since = watched, time.monotonic()
                continue
            if watched is None or time.monotonic() - since < self.timeout:
                continue
            description = _describe(watched[0], watched[1], self.group_name)
            error = DistTimeoutError(
                f"rank {self.rank}: {description} did not complete within {self.timeout:.1f}s: "
                "another rank of the group has not started the same operation (or died)"
            )
            report = (
                f"pluribus-mpi: {type(error).__name__}: {error}\n"
                f"pluribus-mpi: rank {self.rank} calls MPI_Abort to end all ranks (MPI cannot "
                "cancel a blocking collective)\n"
            )
            try:
                os.write(2, report.encode(errors="replace"))
            except OSError:
                pass
            time.sleep(0.2)  # let mpiexec forward the report
            MPI.COMM_WORLD.Abort(1)
            return

    def _begin(self, name: str, args: tuple, key_array: Any) -> _Pending:
        if self.closed or self.aborted is not None:
            self._check_open(_describe(name, key_array, self.group_name))
        if key_array is not None and type(key_array).__module__.startswith("cupy"):
            if not self.cuda_aware:
                what = _describe(name, key_array, self.group_name)
                raise TypeError(
                    f"rank {self.rank}: {what}: this MPI library is not CUDA-aware "
                    f"({self.cuda_reason}); set PLURIBUS_GPU_STAGING=1 to copy through host "
                    "memory, use a CUDA-aware MPI build, or carry cupy arrays with NCCL "
                    '(backend="cpu:mpi,cuda:nccl")'
                )
            _sync_device(key_array)
        starter = self._starters[name]
        try:
            with self.start_lock:
                return starter(*args)
        except MPI.Exception as exc:
            raise self.translate(exc, _describe(name, key_array, self.group_name)) from exc
        except TypeError as exc:  # a dtype MPI cannot carry here; nothing was started
            raise TypeError(f"rank {self.rank}: {exc}") from exc

    # -- starts: one MPI call each ----------------------------------------------------------------

    def _start_all_reduce(self, array: Any, op: ReduceOp) -> _Pending:
        mpi_type, mpi_op = mpi_type_and_op(array.dtype, op, array)
        pending = _Pending(self.comm.Iallreduce(MPI.IN_PLACE, [array, mpi_type], mpi_op))
        if op is ReduceOp.AVG and self.size > 1:
            pending.finishers.append(_averager(array, self.size))
        return pending

    def _start_broadcast(self, array: Any, src: int) -> _Pending:
        return _Pending(self.comm.Ibcast([array, MPI.BYTE], src))

    def _start_reduce(self, array: Any, dst: int, op: ReduceOp) -> _Pending:
        mpi_type, mpi_op = mpi_type_and_op(array.dtype, op, array)
        if self.rank == dst:
            pending = _Pending(self.comm.Ireduce(MPI.IN_PLACE, [array, mpi_type], mpi_op, dst))
            if op is ReduceOp.AVG and self.size > 1:
                pending.finishers.append(_averager(array, self.size))
            return pending
        return _Pending(self.comm.Ireduce([array, mpi_type], None, mpi_op, dst))

    def _start_all_gather(self, outputs: list[Any], array: Any) -> _Pending:
        recv, counts, displs, regular = _span(outputs)
        send, keep = self._send_side(array, outputs[self.rank], recv)
        if regular:
            request = self.comm.Iallgather(send, [recv, MPI.BYTE])
        else:
            request = self.comm.Iallgatherv(send, [recv, counts, displs, MPI.BYTE])
        return _Pending(request, (outputs, array, keep))

    def _send_side(self, array: Any, own_block: Any, recv: Any) -> tuple[Any, Any]:
        """IN_PLACE when ``array`` is this rank's block of the output, a copy when it overlaps the
        output elsewhere (MPI forbids aliased buffers), else ``array`` itself."""
        if _same_memory(array, own_block):
            return MPI.IN_PLACE, None
        if array.nbytes and _overlaps(array, _byte_address(recv), len(recv)):
            copy = array.copy()
            return [copy, MPI.BYTE], copy
        return [array, MPI.BYTE], None

    def _start_reduce_scatter(self, output: Any, inputs: list[Any], op: ReduceOp) -> _Pending:
        dtype = np.dtype(output.dtype)
        mpi_type, mpi_op = mpi_type_and_op(dtype, op, output)
        send, counts, displs, _ = _span(inputs)
        consecutive = all(displs[i + 1] == displs[i] + counts[i] for i in range(len(inputs) - 1))
        keep: tuple = (inputs,)
        if not consecutive or displs[0] != 0:
            send = _compact(inputs)
            keep = (inputs, send)
        target = output
        if output.nbytes and _overlaps(output, _address_of(send), _len_of(send)):
            target = output.copy()  # MPI forbids receiving into the input
        itemsize = dtype.itemsize
        elements = [n // itemsize for n in counts]
        if all(n == elements[0] for n in elements):
            request = self.comm.Ireduce_scatter_block([send, mpi_type], [target, mpi_type], mpi_op)
        else:
            request = self.comm.Ireduce_scatter(
                [send, mpi_type], [target, mpi_type], elements, mpi_op
            )
        pending = _Pending(request, keep + (output, target))
        if target is not output:
            pending.finishers.append(_copier(output, target))
        if op is ReduceOp.AVG and self.size > 1:
            pending.finishers.append(_averager(output, self.size))
        return pending

    def _start_all_to_all(self, outputs: list[Any], inputs: list[Any]) -> _Pending:
        recv, rcounts, rdispls, rregular = _span(outputs)
        send, scounts, sdispls, sregular = _span(inputs)
        keep: tuple = (outputs, inputs)
        if len(send) and len(recv) and _ranges_meet(send, recv):
            # In-place exchange: MPI forbids aliased buffers, so send from a copy.
            compact = _compact(inputs)
            keep = keep + (compact,)
            send, sdispls = compact, _offsets(scounts)
            sregular = all(n == scounts[0] for n in scounts)
        if rregular and sregular and scounts[0] == rcounts[0]:
            request = self.comm.Ialltoall([send, MPI.BYTE], [recv, MPI.BYTE])
        else:
            request = self.comm.Ialltoallv(
                [send, scounts, sdispls, MPI.BYTE], [recv, rcounts, rdispls, MPI.BYTE]
            )
        return _Pending(request, keep)

    def _start_gather(self, array: Any, outputs: list[Any] | None, dst: int) -> _Pending:
        if self.rank != dst:
            return _Pending(self.comm.Igatherv([array, MPI.BYTE], None, dst), (array,))
        assert outputs is not None
        recv, counts, displs, regular = _span(outputs)
        send, keep = self._send_side(array, outputs[dst], recv)
        if regular and counts[0] == array.nbytes:
            request = self.comm.Igather(send, [recv, MPI.BYTE], dst)
        else:
            request = self.comm.Igatherv(send, [recv, counts, displs, MPI.BYTE], dst)
        return _Pending(request, (array, outputs, keep))

    def _start_scatter(self, array: Any, inputs: list[Any] | None, src: int) -> _Pending:
        if self.rank != src:
            return _Pending(self.comm.Iscatterv(None, [array, MPI.BYTE], src), (array,))
        assert inputs is not None
        send, counts, displs, regular = _span(inputs)
        keep: tuple = (array, inputs)
        if _same_memory(array, inputs[src]):
            recv: Any = MPI.IN_PLACE
        elif array.nbytes and _overlaps(array, send.address, len(send)):
            compact = _compact(inputs)
            keep = keep + (compact,)
            send, displs = compact, _offsets(counts)
            recv = [array, MPI.BYTE]
        else:
            recv = [array, MPI.BYTE]
        if regular and counts[0] == array.nbytes:
            request = self.comm.Iscatter([send, MPI.BYTE], recv, src)
        else:
            request = self.comm.Iscatterv([send, counts, displs, MPI.BYTE], recv, src)
        return _Pending(request, keep)

    def _start_barrier(self) -> _Pending:
        return _Pending(self.comm.Ibarrier())

    def _start_send(self, array: Any, dst: int, tag: int) -> _Pending:
        return _Pending(self.comm.Isend([array, MPI.BYTE], dst, tag), (array,))

    def _start_recv(self, array: Any, src: int, tag: int) -> _Pending:
        status = MPI.Status()
        pending = _Pending(self.comm.Irecv([array, MPI.BYTE], src, tag), (array,), status)
        pending.finishers.append(_size_checker(self.rank, array, src, tag, status))
        return pending

    # -- the Backend interface (blocking) ---------------------------------------------------------

    def send(self, array: Any, dst: int, tag: int = 0) -> None:
        self.execute("send", (array, dst, tag))

    def recv(self, array: Any, src: int, tag: int = 0) -> None:
        self.execute("recv", (array, src, tag))

    def sendrecv(self, send_array: Any, dst: int, recv_array: Any, src: int, tag: int = 0) -> None:
        receive = self.start("recv", (recv_array, src, tag))
        self.start("send", (send_array, dst, tag)).wait()
        receive.wait()

    def all_reduce(self, array: Any, op: ReduceOp) -> None:
        # Replaced per instance by the fast all-reduce where blocking calls are allowed.
        self.execute("all_reduce", (array, op))

    def broadcast(self, array: Any, src: int) -> None:
        self.execute("broadcast", (array, src))

    def reduce(self, array: Any, dst: int, op: ReduceOp) -> None:
        self.execute("reduce", (array, dst, op))

    def all_gather(self, outputs: list[Any], array: Any) -> None:
        self.execute("all_gather", (outputs, array))

    def reduce_scatter(self, output: Any, inputs: list[Any], op: ReduceOp) -> None:
        self.execute("reduce_scatter", (output, inputs, op))

    def all_to_all(self, outputs: list[Any], inputs: list[Any]) -> None:
        self.execute("all_to_all", (outputs, inputs))

    def gather(self, array: Any, outputs: list[Any] | None, dst: int) -> None:
        self.execute("gather", (array, outputs, dst))

    def scatter(self, array: Any, inputs: list[Any] | None, src: int) -> None:
        self.execute("scatter", (array, inputs, src))

    def barrier(self) -> None:
        self.execute("barrier", ())

    def unsupported(self, dtype: np.dtype, op: ReduceOp) -> str | None:
        return None  # every dtype and op the core accepts has an MPI type and operation

    # -- sub-groups and life cycle ----------------------------------------------------------------

    def new_subgroup(self, ranks: list[int], ctx: Any) -> MPIBackend:
        """A communicator of the given ranks of this one (only its members call this)."""
        self._check_open(f"new_group({ranks})")
        parent_group = self.comm.Get_group()
        try:
            members = parent_group.Incl(list(ranks))
        finally:
            parent_group.Free()
        # Every member of the new group derives the same tag from the group's name, which every
        # rank of the parent computes identically.
        tag = zlib.crc32(ctx.group_name.encode()) % (1 << 20)
        try:
            with self.start_lock:
                comm = self.comm.Create_group(members, tag)
        finally:
            members.Free()
        if comm.Get_rank() != ctx.rank:
            raise PluribusError(
                f"rank {self.rank}: MPI placed this rank at {comm.Get_rank()} of sub-group "
                f"{ctx.group_name!r}, the core at {ctx.rank}"
            )
        sub = MPIBackend(comm, ctx.timeout, self.cuda_aware, ctx.group_name)
        sub.cuda_reason = self.cuda_reason
        self.subgroups.append(sub)
        return sub

    def abort(self, reason: str) -> None:
        """Make every wait on this rank return an error at once. MPI_Abort (ending the whole
        job) is what an uncaught exception does; this only unblocks this rank."""
        self.aborted = reason

    def close(self) -> None:
        """Free the communicator (requests still in flight complete first, as MPI defines)."""
        if self.closed:
            return
        self.closed = True
        if self.owns_comm and not MPI.Is_finalized():
            try:
                self.comm.Free()
            except MPI.Exception:
                pass

    cuda_reason = ""


# -- helpers used by the starts --------------------------------------------------------------------


#: Synchronous operations that run as MPI blocking calls (see MPIBackend.blocking).
_BLOCKING_CALLS = frozenset({"all_reduce", "broadcast", "barrier"})


#: How often the watchdog looks at a blocking call's deadline, in seconds.
WATCHDOG_PERIOD = 0.25


def _describe(name: str, key_array: Any, group_name: str) -> str:
    if key_array is None:
        return f"{name} on group {group_name!r}"
    return (
        f"{name}(shape={tuple(key_array.shape)}, dtype={key_array.dtype}) on group {group_name!r}"
    )


def _copier(device_item: Any, host_item: Any) -> Callable[[], None]:
    def copy_back() -> None:
        if isinstance(device_item, list):
            for d, h in zip(device_item, host_item, strict=True):
                if d is not h:
                    _copy_into(d, h)
        elif device_item is not None and device_item is not host_item:
            _copy_into(device_item, host_item)

    return copy_back


def _copy_into(target: Any, source: Any) -> None:
    if device_of(target) == "cuda" and device_of(source) != "cuda":
        target.set(source)
    else:
        target[...] = source


def _averager(array: Any, size: int) -> Callable[[], None]:
    def average() -> None:
        np.divide(array, size, out=array)

    return average


def _size_checker(rank: int, array: Any, src: int, tag: int, status: Any) -> Callable[[], None]:
    def check() -> None:
        got = status.Get_count(MPI.BYTE)
        if got != array.nbytes:
            raise ValueError(
                f"rank {rank}: rank {src} sent {got} bytes (tag {tag}) but this rank expected "
                f"{array.nbytes}; the ranks passed arrays of different sizes"
            )

    return check


def _offsets(counts: list[int]) -> list[int]:
    out, total = [], 0
    for n in counts:
        out.append(total)
        total += n
    return out


def _address_of(buffer: Any) -> int:
    return buffer.address if hasattr(buffer, "address") else _address(buffer)


def _len_of(buffer: Any) -> int:
    return len(buffer) if hasattr(buffer, "address") else int(buffer.nbytes)


def _ranges_meet(a: Any, b: Any) -> bool:
    a_low, b_low = _address_of(a), _address_of(b)
    return a_low < b_low + _len_of(b) and b_low < a_low + _len_of(a)


# -- creation and failure handling -----------------------------------------------------------------


def create_world(
    rank: int, size: int, timeout: float, options: dict[str, Any], group_name: str = "world"
) -> MPIBackend:
    """The world group's backend: a private duplicate of COMM_WORLD, after checking that the
    core's rank and size are MPI's."""
    abort_option = options.get("abort_on_error")
    if abort_option is None:
        abort_option = abort_on_error_default()
    if abort_option:
        install_excepthook()
    world = MPI.COMM_WORLD
    mpi_rank, mpi_size = world.Get_rank(), world.Get_size()
    if mpi_size == 1 and size > 1:
        raise PluribusError(
            f"rank {rank}: the mpi backend was asked for a world of {size} ranks, but this "
            "process is not part of an MPI job of that size (MPI sees 1 rank). Start MPI "
            f"jobs with mpiexec: `mpiexec -n {size} python train.py` (pluribus-run starts "
            "plain processes: use gloo with it)"
        )
    problem = None
    if (rank, size) != (mpi_rank, mpi_size):
        problem = (
            f"rank {mpi_rank}: init_process_group(rank={rank}, world_size={size}) disagrees with "
            f"MPI, which runs this process as rank {mpi_rank} of {mpi_size}; leave rank and "
            "world_size unset (or equal to MPI's) under mpiexec"
        )
    else:
        problem = env_disagreement(mpi_rank, mpi_size)
    raise_if_any(world, problem, "start the mpi backend")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        warnings.warn(
            f"rank {mpi_rank}: MPI was initialised without MPI_THREAD_MULTIPLE (thread level "
            f"{MPI.Query_thread()}); call pluribus collectives from one thread at a time, or let "
            "mpi4py initialise MPI (its default level is 'multiple')",
            RuntimeWarning,
            stacklevel=2,
        )
    aware, reason = cuda_support()
    option = options.get("cuda_aware")
    if option is not None:
        aware, reason = bool(option), f"backend_options cuda_aware={option}"
    backend = MPIBackend(world.Dup(), timeout, aware, group_name)
    backend.cuda_reason = reason
    return backend


def raise_if_any(comm: Any, problem: str | None, what: str) -> None:
    """Raise on every rank when any rank found a ``problem`` (so that none waits for it)."""
    problems = [p for p in comm.allgather(problem) if p]  # start-up only: pickling is fine
    if problem:
        raise PluribusError(problem)
    if problems:
        raise PluribusError(
            f"rank {comm.Get_rank()}: could not {what} because another rank failed: {problems[0]}"
        )


def abort_on_error_default() -> bool:
    return os.environ.get(ABORT_ENV, "1").strip().lower() not in ("0", "false", "no")


_hook_lock = threading.Lock()
_previous_hook: Callable | None = None


def install_excepthook() -> None:
    """On an uncaught exception print the traceback, then MPI_Abort the whole job, so that the
    other ranks do not wait forever for this one (what ``python -m mpi4py`` does)."""
    global _previous_hook
    with _hook_lock:
        if _previous_hook is not None:
            return
        _previous_hook = sys.excepthook
        sys.excepthook = _abort_on_uncaught


def uninstall_excepthook() -> None:
    global _previous_hook
    with _hook_lock:
        if _previous_hook is not None and sys.excepthook is _abort_on_uncaught:
            sys.excepthook = _previous_hook
        _previous_hook = None


def _abort_on_uncaught(exc_type, exc, tb) -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    message = f"pluribus-mpi: uncaught exception on rank {rank} of {size}:\n{text}"
    aborting = size > 1 and MPI.Is_initialized() and not MPI.Is_finalized()
    if aborting:
        message += f"pluribus-mpi: rank {rank} calls MPI_Abort to end all {size} ranks\n"
    if _previous_hook not in (None, sys.__excepthook__):
        try:  # a hook someone else installed (an error-file writer, say) still runs
            _previous_hook(exc_type, exc, tb)
        except BaseException:
            pass
    sys.stdout.flush()
    # One write, so that mpiexec forwards the whole report before MPI_Abort ends the job.
    try:
        sys.stderr.flush()
        os.write(2, message.encode(errors="replace"))
    except OSError:
        pass
    if aborting:
        time.sleep(0.2)  # let mpiexec's output forwarding drain before every rank is killed
        world.Abort(1)
