"""The NCCL backend: one NCCL communicator per group, collectives on a communication stream.

Every operation is enqueued on the backend's own CUDA stream after an event recorded on the
caller's current stream, so it reads its input only once the caller's earlier kernels have
written it; its completion is an event on the communication stream. A synchronous call makes
the caller's stream wait on that event (the host does not block, as in torch's NCCL backend),
so the result is safe to use by anything issued afterwards on the caller's stream. An
asynchronous call returns an :class:`NcclWork` backed by the event.

A watchdog thread follows the operations in flight: one that does not finish within the group's
timeout, or an asynchronous error that NCCL reports, aborts the communicator. The error is
raised by ``Work.wait`` and by the next operation on the group; it is never dropped.

NCCL has no message tags: point-to-point messages between two ranks match in the order they
were issued, as with torch's NCCL backend.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from pluribus import Backend, BackendContext, ReduceOp
from pluribus.arrays import bfloat16_dtype, byte_view
from pluribus.errors import DistTimeoutError, PeerError, PluribusError
from pluribus.work import Work

from .runtime import CupyRuntime

UNIQUE_ID_KEY = "nccl/unique_id"
#: Where each rank says which GPU it chose: "<host> <PCI bus id>|<device index>".
GPU_KEY = "nccl/gpu"
UNIQUE_ID_BYTES = 128
#: NCCL's own AVG reduction appeared in NCCL 2.10; before, AVG is SUM and a division.
NATIVE_AVG_VERSION = 21000
#: How often the watchdog looks at the operations in flight, in seconds.
WATCHDOG_INTERVAL = 0.05
BLOCKING_WAIT_ENV = "PLURIBUS_NCCL_BLOCKING_WAIT"

_NCCL_TYPE_NAMES = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "bfloat16": "NCCL_BFLOAT16",
}
#: NCCL has no 16-bit integers: they are reduced as int32 and cast back (exact for MIN/MAX,
#: and SUM/PRODUCT wrap modulo 2**16 exactly as int16 arithmetic does).
_WIDENED = {"int16": np.dtype(np.int32), "uint16": np.dtype(np.int32)}
_NCCL_OPS = {
    ReduceOp.SUM: "NCCL_SUM",
    ReduceOp.PRODUCT: "NCCL_PROD",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.MAX: "NCCL_MAX",
}
#: bool travels as uint8 holding 0 or 1, where logical or/and are MAX/MIN.
_BOOL_OPS = {
    ReduceOp.SUM: "NCCL_MAX",
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.BOR: "NCCL_MAX",
    ReduceOp.PRODUCT: "NCCL_MIN",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.BAND: "NCCL_MIN",
}


# -- the unique id --------------------------------------------------------------------------------


def encode_unique_id(unique_id: Any) -> bytes:
    """The 128 bytes of an id from ``nccl.get_unique_id()``.

    cupy up to 13 returns a tuple of signed chars (-128..127), later versions return bytes.
    """
    if isinstance(unique_id, (bytes, bytearray)):
        raw = bytes(unique_id)
    else:
        raw = bytes(int(v) & 0xFF for v in unique_id)
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


def unique_id_as_tuple(raw: bytes) -> tuple[int, ...]:
    """The id in the form older cupy's NcclCommunicator takes: signed chars."""
    return tuple(b - 256 if b > 127 else b for b in raw)


def make_communicator(nccl: Any, size: int, raw_id: bytes, rank: int) -> Any:
    """``NcclCommunicator(size, id, rank)`` in whichever id form this cupy accepts."""
    try:
        return nccl.NcclCommunicator(size, unique_id_as_tuple(raw_id), rank)
    except TypeError:  # cupy 14 takes the id as bytes
        return nccl.NcclCommunicator(size, raw_id, rank)


def exchange_unique_id(ctx: BackendContext, nccl: Any) -> bytes:
    """Rank 0 makes the communicator's id and publishes it in the group's store."""
    if ctx.rank == 0:
        raw = encode_unique_id(nccl.get_unique_id())
        ctx.store.set(UNIQUE_ID_KEY, raw)
        return raw
    try:
        raw = ctx.store.get(UNIQUE_ID_KEY, ctx.timeout)
    except DistTimeoutError as exc:
        raise DistTimeoutError(
            f"rank {ctx.rank}: rank 0 of group {ctx.group_name!r} did not publish its NCCL id "
            f"within {ctx.timeout:.0f}s; check that rank 0 started and chose the nccl backend"
        ) from exc
    return bytes(raw)


def choose_device(ctx: BackendContext, runtime: CupyRuntime) -> int:
    """The GPU of this rank: ``device_id`` option, else LOCAL_RANK, else rank modulo GPUs."""
    count = runtime.device_count()
    if ctx.options.get("device_id") is not None:
        device, source = int(ctx.options["device_id"]), "backend_options['device_id']"
    elif os.environ.get("LOCAL_RANK"):
        device, source = int(os.environ["LOCAL_RANK"]), "LOCAL_RANK"
    else:
        device, source = ctx.rank % count, "rank modulo the GPU count"
    if not 0 <= device < count:
        raise PluribusError(
            f"rank {ctx.rank}: {source} asks for GPU {device} but {count} GPU(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            "NCCL needs one GPU per rank on each host"
        )
    return device


def check_one_rank_per_gpu(ctx: BackendContext, identity: str, device: int) -> None:
    """Refuse, on every rank and before NCCL starts, a group in which two ranks chose the same
    GPU: NCCL would fail or hang there. ``identity`` names the GPU across the job (host and PCI
    bus id, so that CUDA_VISIBLE_DEVICES cannot hide a clash)."""
    ctx.store.set(f"{GPU_KEY}/{ctx.rank}", f"{identity}|{device}")
    owners: dict[str, list[int]] = {}
    devices: dict[str, str] = {}
    for rank in range(ctx.size):
        try:
            value = bytes(ctx.store.get(f"{GPU_KEY}/{rank}", ctx.timeout)).decode()
        except DistTimeoutError as exc:
            raise DistTimeoutError(
                f"rank {ctx.rank}: rank {rank} of group {ctx.group_name!r} did not say which GPU "
                f"it uses within {ctx.timeout:.0f}s; check that every rank chose the nccl backend"
            ) from exc
        seen, _, index = value.rpartition("|")
        owners.setdefault(seen, []).append(rank)
        devices[seen] = index
    shared = {gpu: ranks for gpu, ranks in owners.items() if len(ranks) > 1}
    if shared:
        clashes = "; ".join(
            f"ranks {', '.join(map(str, ranks))} all use GPU {devices[gpu]} ({gpu})"
            for gpu, ranks in shared.items()
        )
        raise PluribusError(
            f"rank {ctx.rank}: group {ctx.group_name!r} cannot use NCCL: {clashes}. NCCL needs "
            "one GPU per rank: give each rank its own (LOCAL_RANK, CUDA_VISIBLE_DEVICES or "
            "backend_options={'device_id': n}), or use the ucc backend (for example "
            "backend='cpu:gloo,cuda:ucc'), which serves ranks sharing a GPU through CUDA IPC"
        )


def create_backend(
    ctx: BackendContext, runtime: CupyRuntime | None = None, device_id: int | None = None
) -> NcclBackend:
    """Build this rank's communicator; every rank of the group calls it at the same time."""
    runtime = runtime or CupyRuntime.load()
    if device_id is None:
        device = choose_device(ctx, runtime)
        check_one_rank_per_gpu(ctx, runtime.device_identity(device), device)
        runtime.use_device(device)  # the rank's arrays are allocated on its GPU from now on
    else:
        device = device_id
    raw = exchange_unique_id(ctx, runtime.nccl)
    comm = _init_communicator(runtime, ctx, raw, device)
    blocking = bool(ctx.options.get("nccl_blocking_wait")) or os.environ.get(
        BLOCKING_WAIT_ENV, ""
    ) not in ("", "0")
    return NcclBackend(
        comm, ctx.rank, ctx.size, ctx.timeout, device, runtime, ctx.group_name, blocking
    )


def _init_communicator(runtime: CupyRuntime, ctx: BackendContext, raw: bytes, device: int):
    """ncclCommInitRank waits for every rank and has no timeout of its own: bound it here."""
    result: dict[str, Any] = {}

    def init() -> None:
        try:
            with runtime.device(device):
                result["comm"] = make_communicator(runtime.nccl, ctx.size, raw, ctx.rank)
        except BaseException as exc:  # reported on the calling thread below
            result["error"] = exc

    thread = threading.Thread(target=init, name=f"pluribus-nccl-init-{ctx.rank}", daemon=True)
    thread.start()
    thread.join(ctx.timeout)
    if thread.is_alive():
        raise DistTimeoutError(
            f"rank {ctx.rank}: the NCCL communicator of group {ctx.group_name!r} "
            f"({ctx.size} ranks) did not form within {ctx.timeout:.0f}s; some rank did not "
            "join: check that every rank started and that each has its own GPU"
        )
    if "error" in result:
        raise PluribusError(
            f"rank {ctx.rank}: creating the NCCL communicator of group {ctx.group_name!r} on "
            f"GPU {device} failed: {result['error']}; NCCL refuses two ranks on one GPU, so "
            "give each rank its own device (LOCAL_RANK or backend_options={'device_id': n})"
        ) from result["error"]
    return result["comm"]


# -- reductions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Reduction:
    """How one (dtype, op) pair is carried out with NCCL."""

    nccl_type: int
    nccl_op: int
    widen: np.dtype | None = None  # reduce a copy in this dtype and cast back
    divide: bool = False  # AVG without NCCL's own: SUM, then divide by the group size


class NcclWork(Work):
    """An NCCL operation in flight, backed by a CUDA event on the communication stream.

    ``wait`` blocks the host until the event has fired (aborting the communicator when the
    timeout passes first) and then orders the caller's current stream after it.
    """

    def __init__(self, backend: NcclBackend, event: Any, description: str, keep: list[Any]):
        self.backend = backend
        self.event = event
        self.description = description
        self.deadline = time.monotonic() + backend.timeout
        self._keep = keep  # arrays and temporaries the GPU still uses
        self._finished = False
        self.failure: BaseException | None = None  # set when the communicator failed first

    def _poll(self) -> bool:
        if self.failure is not None:
            return False
        if not self._finished and self.event.done:
            self._finished = True
            self._keep = []
        return self._finished

    def is_completed(self) -> bool:
        return self._poll() or self.failure is not None

    def exception(self) -> BaseException | None:
        return self.failure

    def wait(self, timeout: float | None = None) -> bool:
        self.backend.wait_for(self, timeout)
        self.backend.order_after(self)
        return True

    def result(self) -> Any:
        self.wait()
        return None


class NcclBackend(Backend):
    """One rank of an NCCL communicator, bound to one GPU."""

    name = "nccl"
    detects_failures = True  # its own dead-peer detection and timeouts
    devices = ("cuda",)

    def __init__(
        self,
        comm: Any,
        rank: int,
        size: int,
        timeout: float,
        device_id: int,
        runtime: CupyRuntime,
        group_name: str = "default",
        blocking_wait: bool = False,
    ):
        super().__init__(rank, size, timeout)
        self.comm = comm
        self.device_id = device_id
        self.runtime = runtime
        self.nccl = runtime.nccl
        self.group_name = group_name
        self.blocking_wait = blocking_wait
        self.native_avg = (
            hasattr(self.nccl, "NCCL_AVG") and runtime.nccl_version() >= NATIVE_AVG_VERSION
        )
        with runtime.device(device_id):
            self.stream = runtime.new_stream()
        self.error: BaseException | None = None
        self._aborted = False
        self._closed = False
        self._lock = threading.RLock()
        self._enqueue_lock = threading.Lock()
        self._enqueuing: tuple[float, str] | None = None  # (deadline, what) while enqueueing
        self._pending: list[NcclWork] = []
        self._wakeup = threading.Condition(self._lock)
        self._watchdog: threading.Thread | None = None
        self._barrier_buffer: Any = None

    def __repr__(self) -> str:
        return f"NcclBackend(rank={self.rank}, size={self.size}, device={self.device_id})"

    # -- what this backend cannot do --------------------------------------------------------------

    def unsupported(self, dtype: Any, op: ReduceOp) -> str | None:
        """Why NCCL cannot reduce ``dtype`` with ``op``, or None when it can."""
        try:
            self._reduction(np.dtype(dtype), op)
        except TypeError as exc:
            return str(exc)
        return None

    def _reduction(self, dtype: np.dtype, op: ReduceOp) -> _Reduction:
        nccl = self.nccl
        if dtype == np.bool_:
            if op not in _BOOL_OPS:
                raise TypeError(
                    f"NCCL cannot reduce bool arrays with {op.name}; use BAND/BOR/SUM/PRODUCT/"
                    "MIN/MAX, or reduce a uint8 copy with SUM and take it modulo 2"
                )
            return _Reduction(nccl.NCCL_UINT8, getattr(nccl, _BOOL_OPS[op]))
        if op.bitwise:
            raise TypeError(
                f"NCCL has no bitwise reductions (BAND, BOR, BXOR), got {op.name} on {dtype}; "
                "reduce this array through a CPU backend (backend='cpu:gloo,cuda:nccl' and "
                "a numpy copy) or use SUM/PRODUCT/MIN/MAX"
            )
        name = _dtype_name(dtype)
        widen = _WIDENED.get(name)
        type_name = _NCCL_TYPE_NAMES.get(widen.name if widen is not None else name)
        if type_name is None or not hasattr(nccl, type_name):
            raise TypeError(
                f"NCCL (through this cupy) has no reduction for dtype {dtype}; cast to float32, "
                "int32 or int64 first"
            )
        if op is ReduceOp.AVG:
            if self.native_avg:
                return _Reduction(getattr(nccl, type_name), nccl.NCCL_AVG, widen)
            if name == "bfloat16":
                raise TypeError(
                    "AVG on bfloat16 needs NCCL 2.10 or newer; reduce with SUM and divide in "
                    "float32"
                )
            return _Reduction(getattr(nccl, type_name), nccl.NCCL_SUM, widen, divide=True)
        return _Reduction(getattr(nccl, type_name), getattr(nccl, _NCCL_OPS[op]), widen)

    # -- enqueueing --------------------------------------------------------------------

    def _check_usable(self, what: str) -> None:
        if self.error is not None:
            raise _rewrap(self.error, f"{what} refused, an earlier NCCL operation failed: ")
        if self._closed:
            raise PluribusError(
                f"rank {self.rank}: the NCCL communicator of group {self.group_name!r} was "
                "destroyed"
            )

    def _check_arrays(self, arrays: list[Any], what: str) -> None:
        for array in arrays:
            if array is None:
                continue
            device = self.runtime.device_of(array)
            if device != self.device_id:
                raise ValueError(
                    f"rank {self.rank}: {what} got an array on cuda:{device}, but this rank's "
                    f"NCCL communicator is bound to cuda:{self.device_id}; allocate it inside "
                    f"`with cupy.cuda.Device({self.device_id}):`"
                )

    def launch(
        self,
        description: str,
        body: Callable[[int], list[Any] | None],
        arrays: list[Any],
    ) -> NcclWork:
        """Run ``body(stream_pointer)`` on the communication stream, after the caller's stream.

        ``body`` issues NCCL calls (and any small kernels, which run on the communication stream
        because it is current) and returns the temporaries it allocated; those and ``arrays``
        stay referenced until the operation has finished on the GPU.
        """
        self._check_usable(description)
        self._check_arrays(arrays, description)
        rt = self.runtime
        label = f"{description} on group {self.group_name!r}"
        # One enqueue at a time (all ranks must issue NCCL calls in one order), but not under
        # self._lock: an enqueue can block in NCCL (connecting to a dead peer), and the
        # watchdog must still be able to abort the communicator then.
        with self._enqueue_lock, rt.device(self.device_id):
            ready = rt.new_event()
            ready.record(rt.current_stream())
            self.stream.wait_event(ready)
            with self._lock:
                self._enqueuing = (time.monotonic() + self.timeout, label)
                self._start_watchdog()
                if not self._pending:  # otherwise the watchdog is polling already
                    self._wakeup.notify_all()
            try:
                with self.stream:
                    temporaries = body(self.stream.ptr) or []
            except Exception as exc:
                if self.error is not None:  # aborted while it was blocked
                    raise _rewrap(self.error, f"{label}: ") from exc
                raise PluribusError(
                    f"rank {self.rank}: NCCL {label} failed when enqueued: {exc}"
                ) from exc
            finally:
                with self._lock:
                    self._enqueuing = None
            done = rt.new_event()
            done.record(self.stream)
            work = NcclWork(self, done, label, list(arrays) + list(temporaries))
            with self._lock:
                self._pending.append(work)
                # the watchdog may have gone to sleep between the enqueue's end and this line
                # (nothing pending, nothing enqueuing): wake it to watch this work
                self._wakeup.notify_all()
        return work

    @contextmanager
    def _grouped(self) -> Iterator[None]:
        """NCCL calls issued inside run as one (needed for send and receive to the same peer)."""
        self.nccl.groupStart()
        try:
            yield
        finally:
            self.nccl.groupEnd()

    def complete(self, work: NcclWork) -> None:
        """What a synchronous call does before returning: the result is safe on the caller's
        stream. With blocking wait the host waits too (and sees a timeout at once)."""
        if self.blocking_wait:
            self.wait_for(work, None)
        self.order_after(work)
        self._check_usable(work.description)

    def order_after(self, work: NcclWork) -> None:
        """Make the caller's current stream wait for ``work``."""
        with self.runtime.device(self.device_id):
            self.runtime.current_stream().wait_event(work.event)

    def wait_for(self, work: NcclWork, timeout: float | None) -> None:
        """Block the host until ``work`` is done; abort the communicator after ``timeout``."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        pause = 0.0
        while True:
            if work._poll():
                return
            if work.failure is not None or self.error is not None:
                raise _rewrap(work.failure or self.error, f"{work.description}: ")
            self.check_async_error()
            if time.monotonic() >= deadline:
                error = DistTimeoutError(
                    f"rank {self.rank}: {work.description} did not finish within {limit:.1f}s; "
                    "the NCCL communicator was aborted (a rank may have died, hung, or called a "
                    "different collective); destroy the group and create a new one"
                )
                self.fail(error)
                raise error
            time.sleep(pause)
            pause = min(max(pause * 2, 1e-5), 1e-3)

    def check_async_error(self) -> None:
        """Raise (after aborting the communicator) an error NCCL reported asynchronously."""
        if self._aborted or self.comm is None:
            return
        try:
            self.comm.check_async_error()
        except Exception as exc:
            error = PeerError(
                f"rank {self.rank}: NCCL reported an asynchronous error on group "
                f"{self.group_name!r}: {exc}; a peer rank probably died or lost its network. "
                "The communicator was aborted: destroy the group and create a new one"
            )
            self.fail(error)
            raise error from exc

    def fail(self, error: BaseException) -> None:
        """Remember the first error and abort the communicator so nothing waits on it."""
        with self._lock:
            if self.error is None:
                self.error = error
            for work in self._pending:
                if not work._poll():
                    work.failure = error
            self._pending.clear()
            self._wakeup.notify_all()
            if self._aborted or self.comm is None:
                return
            self._aborted = True
            comm = self.comm
        try:  # outside the lock: an enqueue blocked in NCCL may hold the communicator
            comm.abort()
        except Exception:  # already torn down: nothing left to stop
            pass

    # -- watchdog --------------------------------------------------------------------

    def _start_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name=f"pluribus-nccl-watchdog-{self.rank}", daemon=True
            )
            self._watchdog.start()

    def _watch(self) -> None:
        with self.runtime.device(self.device_id):
            while True:
                with self._lock:
                    while not self._pending and self._enqueuing is None and not self._closed:
                        self._wakeup.wait()
                    if self._closed or self._aborted:
                        self._pending.clear()
                        return
                    self._pending = [w for w in self._pending if not w._poll()]
                    now = time.monotonic()
                    late = [w.description for w in self._pending if now >= w.deadline]
                    if self._enqueuing is not None and now >= self._enqueuing[0]:
                        late.append(f"{self._enqueuing[1]} (blocked while being enqueued)")
                if late:
                    self.fail(
                        DistTimeoutError(
                            f"rank {self.rank}: {late[0]} did not finish within "
                            f"{self.timeout:.1f}s; the NCCL communicator was aborted (a rank may "
                            "have died, hung, or called a different collective); destroy the "
                            "group and create a new one"
                        )
                    )
                    continue
                try:
                    self.check_async_error()
                except PluribusError:
                    continue
                with self._lock:
                    self._wakeup.wait(WATCHDOG_INTERVAL)

    # -- collectives (asynchronous forms) ---------------------------------------------------------

    def _reduce_buffers(self, arrays: list[Any], how: _Reduction) -> list[Any]:
        """The buffers NCCL reduces: the arrays themselves, or widened copies of them."""
        if how.widen is None:
            return arrays
        return [a.astype(how.widen) for a in arrays]

    def _write_back(self, target: Any, buffer: Any, how: _Reduction) -> None:
        if buffer is not target:
            target[...] = buffer.reshape(target.shape).astype(target.dtype)
        if how.divide:
            target /= self.size

    def all_reduce_async(self, array: Any, op: ReduceOp) -> NcclWork:
        how = self._reduction(np.dtype(array.dtype), op)
        ptr = self.runtime.pointer

        def body(stream: int) -> list[Any]:
            (buffer,) = self._reduce_buffers([array], how)
            if array.size:
                self.comm.allReduce(
                    ptr(buffer), ptr(buffer), array.size, how.nccl_type, how.nccl_op, stream
                )
            self._write_back(array, buffer, how)
            return [buffer]

        return self.launch(f"all_reduce({op.name}, {_shape(array)})", body, [array])

    def broadcast_async(self, array: Any, src: int) -> NcclWork:
        ptr = self.runtime.pointer

        def body(stream: int) -> None:
            if array.nbytes:
                self.comm.broadcast(
                    ptr(array), ptr(array), array.nbytes, self.nccl.NCCL_UINT8, src, stream
                )

        return self.launch(f"broadcast(src={src}, {_shape(array)})", body, [array])

    def reduce_async(self, array: Any, dst: int, op: ReduceOp) -> NcclWork:
        how = self._reduction(np.dtype(array.dtype), op)
        ptr = self.runtime.pointer

        def body(stream: int) -> list[Any]:
            (buffer,) = self._reduce_buffers([array], how)
            if array.size:
                self.comm.reduce(
                    ptr(buffer), ptr(buffer), array.size, how.nccl_type, how.nccl_op, dst, stream
                )
            if self.rank == dst:
                self._write_back(array, buffer, how)
            return [buffer]

        return self.launch(f"reduce({op.name}, dst={dst}, {_shape(array)})", body, [array])

    def all_gather_async(self, outputs: list[Any], array: Any) -> NcclWork:
        ptr = self.runtime.pointer
        nbytes = array.nbytes
        even = all(o.nbytes == nbytes for o in outputs)

        def body(stream: int) -> list[Any]:
            u8 = self.nccl.NCCL_UINT8
            if even and nbytes:
                base = _consecutive(outputs, nbytes, ptr)
                if base is not None:
                    self.comm.allGather(ptr(array), base, nbytes, u8, stream)
                    return []
                gathered = self.runtime.empty(nbytes * self.size, np.uint8)
                self.comm.allGather(ptr(array), ptr(gathered), nbytes, u8, stream)
                for i, out in enumerate(outputs):
                    byte_view(out)[...] = gathered[i * nbytes : (i + 1) * nbytes]
                return [gathered]
            with self._grouped():
                for peer in range(self.size):
                    if peer == self.rank:
                        continue
                    if nbytes:
                        self.comm.send(ptr(array), nbytes, u8, peer, stream)
                    if outputs[peer].nbytes:
                        self.comm.recv(ptr(outputs[peer]), outputs[peer].nbytes, u8, peer, stream)
            _copy_bytes(outputs[self.rank], array, ptr)
            return []

        kind = "even" if even else "uneven"
        return self.launch(f"all_gather({kind}, {_shape(array)})", body, [array, *outputs])

    def reduce_scatter_async(self, output: Any, inputs: list[Any], op: ReduceOp) -> NcclWork:
        how = self._reduction(np.dtype(output.dtype), op)
        if how.nccl_op == getattr(self.nccl, "NCCL_AVG", None):
            # NCCL 2.28's ncclAvg reduce-scatter left the last element of an odd-sized block
            # unwritten (seen at world size 1 on an H100): sum, then divide.
            how = replace(how, nccl_op=self.nccl.NCCL_SUM, divide=True)
        ptr = self.runtime.pointer
        count = output.size
        even = all(x.size == count for x in inputs)

        def body(stream: int) -> list[Any]:
            itemsize = (how.widen or np.dtype(output.dtype)).itemsize
            if even:
                base = None
                if how.widen is None:
                    base = _consecutive(inputs, count * itemsize, ptr)
                temporaries: list[Any] = []
                if base is None:
                    packed = self.runtime.empty(count * self.size, how.widen or output.dtype)
                    for i, x in enumerate(inputs):
                        packed[i * count : (i + 1) * count] = x.reshape(-1)
                    base = ptr(packed)
                    temporaries.append(packed)
                (result,) = self._reduce_buffers([output], how)
                if count:
                    self.comm.reduceScatter(
                        base, ptr(result), count, how.nccl_type, how.nccl_op, stream
                    )
                self._write_back(output, result, how)
                return [*temporaries, result]
            # Uneven blocks: one reduce per block, rooted at the rank that keeps it.
            buffers = self._reduce_buffers(list(inputs), how)
            (result,) = self._reduce_buffers([output], how)
            with self._grouped():
                for root, block in enumerate(buffers):
                    if block.size:
                        target = ptr(result) if root == self.rank else ptr(block)
                        self.comm.reduce(
                            ptr(block),
                            target,
                            block.size,
                            how.nccl_type,
                            how.nccl_op,
                            root,
                            stream,
                        )
            self._write_back(output, result, how)
            return [*buffers, result]

        kind = "even" if even else "uneven"
        return self.launch(
            f"reduce_scatter({op.name}, {kind}, {_shape(output)})", body, [output, *inputs]
        )

    def all_to_all_async(self, outputs: list[Any], inputs: list[Any]) -> NcclWork:
        ptr = self.runtime.pointer

        def body(stream: int) -> None:
            u8 = self.nccl.NCCL_UINT8
            with self._grouped():
                for peer in range(self.size):
                    if peer == self.rank:
                        continue
                    if inputs[peer].nbytes:
                        self.comm.send(ptr(inputs[peer]), inputs[peer].nbytes, u8, peer, stream)
                    if outputs[peer].nbytes:
                        self.comm.recv(ptr(outputs[peer]), outputs[peer].nbytes, u8, peer, stream)
            _copy_bytes(outputs[self.rank], inputs[self.rank], ptr)

        return self.launch("all_to_all", body, [*outputs, *inputs])

    def gather_async(self, array: Any, outputs: list[Any] | None, dst: int) -> NcclWork:
        ptr = self.runtime.pointer

        def body(stream: int) -> None:
            u8 = self.nccl.NCCL_UINT8
            if self.rank != dst:
                if array.nbytes:
                    self.comm.send(ptr(array), array.nbytes, u8, dst, stream)
                return
            assert outputs is not None
            with self._grouped():
                for peer in range(self.size):
                    if peer != self.rank and outputs[peer].nbytes:
                        self.comm.recv(ptr(outputs[peer]), outputs[peer].nbytes, u8, peer, stream)
            _copy_bytes(outputs[self.rank], array, ptr)

        return self.launch(f"gather(dst={dst}, {_shape(array)})", body, [array, *(outputs or [])])

    def scatter_async(self, array: Any, inputs: list[Any] | None, src: int) -> NcclWork:
        ptr = self.runtime.pointer

        def body(stream: int) -> None:
            u8 = self.nccl.NCCL_UINT8
            if self.rank != src:
                if array.nbytes:
                    self.comm.recv(ptr(array), array.nbytes, u8, src, stream)
                return
            assert inputs is not None
            with self._grouped():
                for peer in range(self.size):
                    if peer != self.rank and inputs[peer].nbytes:
                        self.comm.send(ptr(inputs[peer]), inputs[peer].nbytes, u8, peer, stream)
            _copy_bytes(array, inputs[self.rank], ptr)

        return self.launch(f"scatter(src={src}, {_shape(array)})", body, [array, *(inputs or [])])

    def send_async(self, array: Any, dst: int) -> NcclWork:
        ptr = self.runtime.pointer

        def body(stream: int) -> None:
            if array.nbytes:
                self.comm.send(ptr(array), array.nbytes, self.nccl.NCCL_UINT8, dst, stream)

        return self.launch(f"send(dst={dst}, {_shape(array)})", body, [array])

    def recv_async(self, array: Any, src: int) -> NcclWork:
        ptr = self.runtime.pointer

        def body(stream: int) -> None:
            if array.nbytes:
                self.comm.recv(ptr(array), array.nbytes, self.nccl.NCCL_UINT8, src, stream)

        return self.launch(f"recv(src={src}, {_shape(array)})", body, [array])

    def barrier_async(self) -> NcclWork:
        if self._barrier_buffer is None:
            with self.runtime.device(self.device_id):
                self._barrier_buffer = self.runtime.zeros(1, np.float32)
        buffer = self._barrier_buffer
        ptr = self.runtime.pointer

        def body(stream: int) -> None:
            self.comm.allReduce(
                ptr(buffer), ptr(buffer), 1, self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM, stream
            )

        return self.launch("barrier", body, [buffer])

    # -- the blocking Backend interface: enqueue, then order the caller's stream after it --------
    # (see complete); the core calls these for synchronous calls, ``start`` for async_op=True

    def send(self, array: Any, dst: int, tag: int = 0) -> None:
        self.complete(self.send_async(array, dst))

    def recv(self, array: Any, src: int, tag: int = 0) -> None:
        self.complete(self.recv_async(array, src))

    def sendrecv(self, send_array: Any, dst: int, recv_array: Any, src: int, tag: int = 0) -> None:
        ptr = self.runtime.pointer

        def body(stream: int) -> None:
            u8 = self.nccl.NCCL_UINT8
            with self._grouped():
                self.comm.send(ptr(send_array), send_array.nbytes, u8, dst, stream)
                self.comm.recv(ptr(recv_array), recv_array.nbytes, u8, src, stream)

        self.launch("sendrecv", body, [send_array, recv_array]).wait()

    def all_reduce(self, array: Any, op: ReduceOp) -> None:
        self.complete(self.all_reduce_async(array, op))

    def broadcast(self, array: Any, src: int) -> None:
        self.complete(self.broadcast_async(array, src))

    def reduce(self, array: Any, dst: int, op: ReduceOp) -> None:
        self.complete(self.reduce_async(array, dst, op))

    def all_gather(self, outputs: list[Any], array: Any) -> None:
        self.complete(self.all_gather_async(outputs, array))

    def reduce_scatter(self, output: Any, inputs: list[Any], op: ReduceOp) -> None:
        self.complete(self.reduce_scatter_async(output, inputs, op))

    def all_to_all(self, outputs: list[Any], inputs: list[Any]) -> None:
        self.complete(self.all_to_all_async(outputs, inputs))

    def gather(self, array: Any, outputs: list[Any] | None, dst: int) -> None:
        self.complete(self.gather_async(array, outputs, dst))

    def scatter(self, array: Any, inputs: list[Any] | None, src: int) -> None:
        self.complete(self.scatter_async(array, inputs, src))

    def barrier(self) -> None:
        """Like any barrier, blocks the host until every rank arrived."""
        self.barrier_async().wait()

    def start(self, name: str, args: tuple) -> NcclWork:
        """Enqueue operation ``name`` on the communication stream from the calling thread and
        return the CUDA event's Work (the core's ``async_op=True``): CUDA streams keep the
        order, so no worker thread is needed. NCCL has no tags: send and recv drop theirs."""
        if name in ("send", "recv"):
            args = args[:2]
        return getattr(self, f"{name}_async")(*args)

    # -- life cycle --------------------------------------------------------------------

    def new_subgroup(self, ranks: list[int], ctx: BackendContext) -> NcclBackend:
        """A communicator of its own for the sub-group, on this rank's GPU.

        ncclCommSplit would have to be called by every rank of this group, but only the members
        of a new group create its backend; so the members build a fresh communicator from a new
        id published in the sub-group's store.
        """
        self._check_usable("new_group")
        return create_backend(ctx, self.runtime, device_id=self.device_id)

    def abort(self, reason: str) -> None:
        self.fail(PluribusError(f"rank {self.rank}: group {self.group_name!r} aborted: {reason}"))

    def close(self) -> None:
        """Let operations in flight finish (up to the timeout), then free the communicator."""
        if self._closed:
            return
        with self._lock:
            pending = list(self._pending)
        for work in pending:
            try:
                self.wait_for(work, None)
            except PluribusError:
                break
        with self._lock:
            self._closed = True
            self._pending.clear()
            self._wakeup.notify_all()
        if self._watchdog is not None:
            self._watchdog.join(1.0)
        if self.comm is not None and not self._aborted:
            with self._enqueue_lock, self.runtime.device(self.device_id):
                self.comm.destroy()
        self.comm = None
        self._barrier_buffer = None


# -- helpers --------------------------------------------------------------------------------------


def _dtype_name(dtype: np.dtype) -> str:
    bf16 = bfloat16_dtype()
    if bf16 is not None and dtype == bf16:
        return "bfloat16"
    return dtype.name


def _shape(array: Any) -> str:
    return f"shape={tuple(array.shape)}, dtype={array.dtype}"


def _consecutive(arrays: list[Any], nbytes: int, ptr: Callable[[Any], int]) -> int | None:
    """The start address when ``arrays`` lie back to back in memory, each ``nbytes`` long."""
    if not arrays:
        return None
    start = ptr(arrays[0])
    for i, array in enumerate(arrays):
        if array.nbytes != nbytes or ptr(array) != start + i * nbytes:
            return None
    return start


def _copy_bytes(target: Any, source: Any, ptr: Callable[[Any], int]) -> None:
    """This rank's own block of a gather or all-to-all (nothing to do when in place)."""
    if target.nbytes and ptr(target) != ptr(source):
        byte_view(target)[...] = byte_view(source)


def _rewrap(error: BaseException, prefix: str) -> BaseException:
    """The recorded error again, as a fresh exception of the same kind with context."""
    if isinstance(error, PeerError):
        return PeerError(prefix + str(error), error.peer)
    if isinstance(error, (DistTimeoutError, PluribusError)):
        return type(error)(prefix + str(error))
    return PluribusError(prefix + str(error))
