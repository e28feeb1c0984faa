"""The MPI backend: one rank's endpoint on a communicator, each operation one MPI call.

Synchronous all-reduce, broadcast and barrier on host arrays are MPI's blocking calls under the
watchdog (:mod:`.failure`); every other operation, and every ``async_op=True`` one through
:meth:`MPIBackend.start`, is one non-blocking MPI call on arrays handed to MPI in place (no
pickling, no copies) whose request an :class:`~.work.MPIWork` waits for. MPI matches collectives
on a communicator in the order they are started, so they are started under a lock. Datatypes
and ops live in :mod:`.datatypes`, memory spans and finishers in :mod:`.buffers`.

Importing this module initialises MPI (``MPI_THREAD_MULTIPLE``), so only ``create`` imports it.
"""

from __future__ import annotations

import threading
import warnings
import zlib
from typing import Any

import numpy as np
from pluribus import Backend, ReduceOp
from pluribus.errors import PluribusError
from pluribus.operations import OPERATIONS

from . import deathwatch
from .buffers import (
    address_of,
    averager,
    byte_address,
    compact,
    copier,
    len_of,
    offsets,
    overlaps,
    ranges_meet,
    same_memory,
    size_checker,
    span,
    sync_device,
)
from .datatypes import MPI, TYPE_AND_OP, mpi_type_and_op
from .env import env_disagreement
from .failure import (
    abort_on_error_default,
    install_excepthook,
    install_exit_check,
    raise_if_any,
    unlink_shared_memory_names,
    watch_blocking_calls,
)
from .probe import cuda_support
from .work import MPIWork, Pending, describe

#: Synchronous operations that run as MPI blocking calls (see MPIBackend.blocking).
BLOCKING_CALLS = frozenset({"all_reduce", "broadcast", "barrier"})


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
        store: Any = None,
    ):
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout)
        self.comm = comm
        self.group_name = group_name
        # The group's store says which ranks never reached a collective that timed out; ``seq``
        # numbers the collectives, blocking ones too (the same on every rank, as MPI's order).
        self.store = store
        self.seq = 0
        self.world_ranks = _world_ranks(comm)
        self.owns_comm = owns_comm
        self.cuda_aware = cuda_aware
        self.devices = ("cpu", "cuda") if cuda_aware else ("cpu",)
        self.aborted: str | None = None
        self.closed = False
        self.subgroups: list[MPIBackend] = []
        # MPI_THREAD_MULTIPLE allows concurrent calls, but collectives on one communicator must
        # be started in the same order on every rank. The core calls a group's collectives one
        # at a time (under its lane lock, which the synchronous all-reduce relies on alone);
        # requests, their sequence numbers and sub-group creation are also started under this.
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
            and name in BLOCKING_CALLS
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
            raise self.translate(exc, describe(name, key_array, self.group_name)) from exc
        if not done:
            MPIWork(self, pending, name, key_array).wait()
            return
        for finish in pending.finishers:
            finish()

    def _fast_all_reduce(self, general: Any) -> Any:
        """The synchronous all-reduce with nothing between the caller and ``MPI_Allreduce`` but
        arming the watchdog: the call users time against raw mpi4py, and what the core calls
        as this backend's ``all_reduce``. AVG, half floats, cupy arrays and a stopped backend
        take ``general``. It takes no lock of its own: the core calls a group's collectives
        one at a time (under the group's lane lock, ``start`` included), which is the start
        order MPI needs."""
        comm, in_place, ndarray = self.comm, MPI.IN_PLACE, np.ndarray
        # Keyed by id(op): ReduceOp members live for good, and Enum's hash is slow.
        types_and_ops = {
            (dtype, id(op)): found
            for (dtype, op), found in TYPE_AND_OP.items()
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
            self.seq += 1  # numbers the call for the watchdog's message
            self._watched = ("all_reduce", array)
            try:
                comm.Allreduce(in_place, [array, found[0]], found[1])
            except MPI.Exception as exc:
                description = describe("all_reduce", array, self.group_name)
                raise self.translate(exc, description) from exc
            finally:
                self._watched = None

        return all_reduce

    # No all_reduce_into: the core copies into ``out`` and calls the in-place all-reduce. MPI
    # asks every rank to pass MPI_IN_PLACE alike, and pluribus lets each rank choose its form;
    # MPI's own out-of-place all-reduce copies sendbuf into recvbuf first too.

    def _blocking_all_reduce(self, array: Any, op: ReduceOp) -> None:
        mpi_type, mpi_op = mpi_type_and_op(array.dtype, op, array)
        self.comm.Allreduce(MPI.IN_PLACE, [array, mpi_type], mpi_op)
        if op is ReduceOp.AVG and self.size > 1:
            averager(array, self.size)()

    def _blocking_broadcast(self, array: Any, src: int) -> None:
        self.comm.Bcast([array, MPI.BYTE], src)

    def _blocking_barrier(self) -> None:
        self.comm.Barrier()

    def _run_blocking(self, name: str, blocking: Any, args: tuple, key_array: Any) -> None:
        """Run ``blocking(*args)``, one blocking MPI call, under the watchdog."""
        with self.start_lock:
            # Arming the watchdog is cheap: the description is made only on expiry.
            self.seq += 1
            self._watched = (name, key_array)
            if self._watchdog is None:
                self._start_watchdog()
            try:
                blocking(*args)
            except MPI.Exception as exc:
                description = describe(name, key_array, self.group_name)
                raise self.translate(exc, description) from exc
            except TypeError as exc:  # a dtype MPI cannot carry here; nothing was started
                raise TypeError(f"rank {self.rank}: {exc}") from exc
            finally:
                self._watched = None

    def _start_watchdog(self) -> None:
        self._watchdog = threading.Thread(
            target=watch_blocking_calls,
            args=(self,),
            name=f"pluribus-mpi-watchdog-{self.rank}",
            daemon=True,
        )
        self._watchdog.start()

    def _begin(self, name: str, args: tuple, key_array: Any) -> Pending:
        if self.closed or self.aborted is not None:
            self._check_open(describe(name, key_array, self.group_name))
        if key_array is not None and type(key_array).__module__.startswith("cupy"):
            if not self.cuda_aware:
                what = describe(name, key_array, self.group_name)
                raise TypeError(
                    f"rank {self.rank}: {what}: this MPI library is not CUDA-aware "
                    f"({self.cuda_reason}); set PLURIBUS_GPU_STAGING=1 to copy through host "
                    "memory, use a CUDA-aware MPI build, or carry cupy arrays with NCCL "
                    '(backend="cpu:mpi,cuda:nccl")'
                )
            sync_device(key_array)
        starter = self._starters[name]
        try:
            with self.start_lock:
                pending = starter(*args)
                if OPERATIONS[name].collective:
                    self.seq += 1
                    pending.seq = self.seq
                return pending
        except MPI.Exception as exc:
            raise self.translate(exc, describe(name, key_array, self.group_name)) from exc
        except TypeError as exc:  # a dtype MPI cannot carry here; nothing was started
            raise TypeError(f"rank {self.rank}: {exc}") from exc

    # -- starts: one MPI call each ----------------------------------------------------------------

    def _start_all_reduce(self, array: Any, op: ReduceOp) -> Pending:
        mpi_type, mpi_op = mpi_type_and_op(array.dtype, op, array)
        pending = Pending(self.comm.Iallreduce(MPI.IN_PLACE, [array, mpi_type], mpi_op))
        if op is ReduceOp.AVG and self.size > 1:
            pending.finishers.append(averager(array, self.size))
        return pending

    def _start_broadcast(self, array: Any, src: int) -> Pending:
        return Pending(self.comm.Ibcast([array, MPI.BYTE], src))

    def _start_reduce(self, array: Any, dst: int, op: ReduceOp) -> Pending:
        mpi_type, mpi_op = mpi_type_and_op(array.dtype, op, array)
        if self.rank == dst:
            pending = Pending(self.comm.Ireduce(MPI.IN_PLACE, [array, mpi_type], mpi_op, dst))
            if op is ReduceOp.AVG and self.size > 1:
                pending.finishers.append(averager(array, self.size))
            return pending
        return Pending(self.comm.Ireduce([array, mpi_type], None, mpi_op, dst))

    def _start_all_gather(self, outputs: list[Any], array: Any) -> Pending:
        recv, counts, displs, regular = span(outputs)
        send, keep = self._send_side(array, outputs[self.rank], recv)
        if regular:
            request = self.comm.Iallgather(send, [recv, MPI.BYTE])
        else:
            request = self.comm.Iallgatherv(send, [recv, counts, displs, MPI.BYTE])
        return Pending(request, (outputs, array, keep))

    def _send_side(self, array: Any, own_block: Any, recv: Any) -> tuple[Any, Any]:
        """IN_PLACE when ``array`` is this rank's block of the output, a copy when it overlaps the
        output elsewhere (MPI forbids aliased buffers), else ``array`` itself."""
        if same_memory(array, own_block):
            return MPI.IN_PLACE, None
        if array.nbytes and overlaps(array, byte_address(recv), len(recv)):
            copy = array.copy()
            return [copy, MPI.BYTE], copy
        return [array, MPI.BYTE], None

    def _start_reduce_scatter(self, output: Any, inputs: list[Any], op: ReduceOp) -> Pending:
        dtype = np.dtype(output.dtype)
        mpi_type, mpi_op = mpi_type_and_op(dtype, op, output)
        send, counts, displs, _ = span(inputs)
        consecutive = all(displs[i + 1] == displs[i] + counts[i] for i in range(len(inputs) - 1))
        keep: tuple = (inputs,)
        if not consecutive or displs[0] != 0:
            send = compact(inputs)
            keep = (inputs, send)
        target = output
        if output.nbytes and overlaps(output, address_of(send), len_of(send)):
            target = output.copy()  # MPI forbids receiving into the input
        itemsize = dtype.itemsize
        elements = [n // itemsize for n in counts]
        if all(n == elements[0] for n in elements):
            request = self.comm.Ireduce_scatter_block([send, mpi_type], [target, mpi_type], mpi_op)
        else:
            request = self.comm.Ireduce_scatter(
                [send, mpi_type], [target, mpi_type], elements, mpi_op
            )
        pending = Pending(request, keep + (output, target))
        if target is not output:
            pending.finishers.append(copier(output, target))
        if op is ReduceOp.AVG and self.size > 1:
            pending.finishers.append(averager(output, self.size))
        return pending

    def _start_all_to_all(self, outputs: list[Any], inputs: list[Any]) -> Pending:
        recv, rcounts, rdispls, rregular = span(outputs)
        send, scounts, sdispls, sregular = span(inputs)
        keep: tuple = (outputs, inputs)
        if len(send) and len(recv) and ranges_meet(send, recv):
            # In-place exchange: MPI forbids aliased buffers, so send from a copy.
            packed = compact(inputs)
            keep = keep + (packed,)
            send, sdispls = packed, offsets(scounts)
            sregular = all(n == scounts[0] for n in scounts)
        if rregular and sregular and scounts[0] == rcounts[0]:
            request = self.comm.Ialltoall([send, MPI.BYTE], [recv, MPI.BYTE])
        else:
            request = self.comm.Ialltoallv(
                [send, scounts, sdispls, MPI.BYTE], [recv, rcounts, rdispls, MPI.BYTE]
            )
        return Pending(request, keep)

    def _start_gather(self, array: Any, outputs: list[Any] | None, dst: int) -> Pending:
        if self.rank != dst:
            return Pending(self.comm.Igatherv([array, MPI.BYTE], None, dst), (array,))
        assert outputs is not None
        recv, counts, displs, regular = span(outputs)
        send, keep = self._send_side(array, outputs[dst], recv)
        if regular and counts[0] == array.nbytes:
            request = self.comm.Igather(send, [recv, MPI.BYTE], dst)
        else:
            request = self.comm.Igatherv(send, [recv, counts, displs, MPI.BYTE], dst)
        return Pending(request, (array, outputs, keep))

    def _start_scatter(self, array: Any, inputs: list[Any] | None, src: int) -> Pending:
        if self.rank != src:
            return Pending(self.comm.Iscatterv(None, [array, MPI.BYTE], src), (array,))
        assert inputs is not None
        send, counts, displs, regular = span(inputs)
        keep: tuple = (array, inputs)
        if same_memory(array, inputs[src]):
            recv: Any = MPI.IN_PLACE
        elif array.nbytes and overlaps(array, send.address, len(send)):
            packed = compact(inputs)
            keep = keep + (packed,)
            send, displs = packed, offsets(counts)
            recv = [array, MPI.BYTE]
        else:
            recv = [array, MPI.BYTE]
        if regular and counts[0] == array.nbytes:
            request = self.comm.Iscatter([send, MPI.BYTE], recv, src)
        else:
            request = self.comm.Iscatterv([send, counts, displs, MPI.BYTE], recv, src)
        return Pending(request, keep)

    def _start_barrier(self) -> Pending:
        return Pending(self.comm.Ibarrier())

    def _start_send(self, array: Any, dst: int, tag: int) -> Pending:
        return Pending(self.comm.Isend([array, MPI.BYTE], dst, tag), (array,))

    def _start_recv(self, array: Any, src: int, tag: int) -> Pending:
        status = MPI.Status()
        pending = Pending(self.comm.Irecv([array, MPI.BYTE], src, tag), (array,), status)
        pending.finishers.append(size_checker(self.rank, array, src, tag, status))
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
        sub = MPIBackend(comm, ctx.timeout, self.cuda_aware, ctx.group_name, store=ctx.store)
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


def _world_ranks(comm: Any) -> list[int]:
    """The COMM_WORLD rank of each rank of ``comm``, in its order (errors name world ranks)."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def create_world(
    rank: int,
    size: int,
    timeout: float,
    options: dict[str, Any],
    group_name: str = "world",
    store: Any = None,
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
    unlink_shared_memory_names()  # every rank has started: nothing is left after a crash
    deathwatch.join(MPI)  # a rank that dies is named, whatever PID mpiexec names
    install_exit_check()
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
    backend = MPIBackend(world.Dup(), timeout, aware, group_name, store=store)
    backend.cuda_reason = reason
    return backend
