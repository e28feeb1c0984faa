"""Every hook pluribus defines. Plugins implement them with :data:`pluribus.hookimpl`.

The families:

* **Backends**: ``pluribus_backends`` yields :class:`~pluribus.types.BackendSpec` records, and
  ``pluribus_probe_backend`` says whether one can run here.
* **Rendezvous** and **group life cycle**: ``pluribus_rendezvous``, ``pluribus_group_created``,
  ``pluribus_group_destroyed``.
* **Operations**: one ``firstresult`` hook per operation, each returning a
  :class:`~pluribus.work.Work`. The core's own implementation is a ``trylast`` plugin that calls
  the backend's ``start`` (``async_op=True``), its native method, or a generic algorithm over
  send/recv. A plugin may take over an operation for some groups (return a Work, or ``None`` to
  pass), or wrap every call with ``@hookimpl(wrapper=True)`` for tracing, checks or
  compression; backends need no hooks.

Every call, synchronous or not, goes through its hook whenever any plugin besides the core
implements or wraps it (or pluggy's hook-call monitoring is on); only when the core's own
implementation is the sole one does a synchronous call skip pluggy and run the same code
directly. A wrapper therefore sees every call on every backend. The arguments of each hook are
those of :data:`pluribus.operations.OPERATIONS`, checked below.

In the collective hooks ranks (``src``, ``dst``) are group-local, ``group`` is the
:class:`~pluribus.group.ProcessGroup`, and the arguments have been validated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pluggy

from .operations import OPERATIONS

if TYPE_CHECKING:
    from .group import ProcessGroup
    from .store import Store
    from .types import Availability, BackendSpec, ReduceOp
    from .work import Work

PROJECT = "pluribus"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# -- backends -------------------------------------------------------------------------------------


@hookspec
def pluribus_backends() -> Iterable[BackendSpec]:
    """Return (or yield) the backends this plugin offers.

    Example, a complete plugin module named by the entry point ``[project.entry-points.pluribus]
    loopback = "loopback_plugin"``::

        from pluribus import Availability, Backend, BackendSpec, hookimpl

        class LoopbackBackend(Backend):
            name = "loopback"
            def send(self, array, dst, tag=0): ...
            def recv(self, array, src, tag=0): ...

        @hookimpl
        def pluribus_backends():
            yield BackendSpec(
                name="loopback",
                create=lambda ctx: LoopbackBackend(ctx.rank, ctx.size, ctx.timeout),
                probe=lambda: Availability(True, version="1.0"),
                description="example backend",
            )
    """


@hookspec(firstresult=True)
def pluribus_probe_backend(spec: BackendSpec) -> Availability | None:
    """Say whether ``spec`` can run here. The default calls ``spec.probe()``; never raise.

    Example, a site plugin that forbids MPI on login nodes::

        @hookimpl
        def pluribus_probe_backend(spec):
            if spec.name == "mpi" and socket.gethostname().startswith("login"):
                return Availability(False, "login node", "submit the job with sbatch")
    """


@hookspec(firstresult=True)
def pluribus_rendezvous(
    init_method: str | None,
    rank: int | None,
    world_size: int | None,
    timeout: float,
    backends: dict[str, str],
) -> tuple[Store, int, int] | None:
    """Return ``(store, rank, world_size)`` when this process was started by a launcher that
    pluribus does not know (mpiexec, srun), or None to let the core use env://, tcp:// or file://.

    ``backends`` maps each device to the backend name asked for. Example, a SLURM plugin::

        @hookimpl
        def pluribus_rendezvous(init_method, rank, world_size, timeout, backends):
            if "SLURM_PROCID" not in os.environ or init_method not in (None, "env://"):
                return None
            rank, size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
            host = os.environ["SLURM_LAUNCH_NODE_IPADDR"]
            return TCPStore(host, 29500, is_master=rank == 0, timeout=timeout), rank, size
    """


# -- group life cycle ----------------------------------------------------------------------------


@hookspec
def pluribus_group_created(group: ProcessGroup) -> None:
    """Called on every member rank after a process group is ready.

    Example, log every group::

        @hookimpl
        def pluribus_group_created(group):
            print(f"group {group.name}: rank {group.rank} of {group.size} on {group.backend_name}")
    """


@hookspec
def pluribus_group_destroyed(group: ProcessGroup) -> None:
    """Called before a group's backends are closed.

    Example::

        @hookimpl
        def pluribus_group_destroyed(group):
            my_stats.pop(group.name, None)
    """


# -- collectives ----------------------------------------------------------------------------------


@hookspec(firstresult=True)
def pluribus_all_reduce(group: ProcessGroup, array: Any, op: ReduceOp, async_op: bool) -> Work:
    """Reduce ``array`` across the group, in place on every rank.

    Example, a wrapper that counts bytes reduced::

        @hookimpl(wrapper=True)
        def pluribus_all_reduce(group, array, op, async_op):
            stats["all_reduce_bytes"] += array.nbytes
            return (yield)
    """


@hookspec(firstresult=True)
def pluribus_all_reduce_into(
    group: ProcessGroup, array: Any, output: Any, op: ReduceOp, async_op: bool
) -> Work:
    """Reduce ``array`` across the group into ``output``, leaving ``array`` as it was
    (``pluribus.all_reduce(array, out=output)``). Other ranks may call the in-place form for
    the same collective: the messages are the same.

    Example, the byte counter above for both forms::

        @hookimpl(wrapper=True)
        def pluribus_all_reduce_into(group, array, output, op, async_op):
            stats["all_reduce_bytes"] += array.nbytes
            return (yield)
    """


@hookspec(firstresult=True)
def pluribus_broadcast(group: ProcessGroup, array: Any, src: int, async_op: bool) -> Work:
    """Copy ``array`` of rank ``src`` into ``array`` on every rank.

    Example, a plugin taking over broadcast for the groups of its own backend (a backend needs
    no hook for this: its ``broadcast`` method, or ``start`` for ``async_op=True``, does it)::

        @hookimpl
        def pluribus_broadcast(group, array, src, async_op):
            if not isinstance(group.backend_for(array), MyBackend):
                return None
            return group.submit(lambda: my_bcast(array, src), async_op, "broadcast")
    """


@hookspec(firstresult=True)
def pluribus_reduce(
    group: ProcessGroup, array: Any, dst: int, op: ReduceOp, async_op: bool
) -> Work:
    """Reduce ``array`` across the group into ``array`` on rank ``dst``; other ranks keep
    their input unchanged.

    Example::

        @hookimpl(wrapper=True)
        def pluribus_reduce(group, array, dst, op, async_op):
            print("reduce to", dst)
            return (yield)
    """


@hookspec(firstresult=True)
def pluribus_all_gather(
    group: ProcessGroup, outputs: list[Any], array: Any, async_op: bool
) -> Work:
    """Gather every rank's ``array`` into ``outputs[rank]`` on every rank (sizes may differ).

    Example::

        @hookimpl(wrapper=True)
        def pluribus_all_gather(group, outputs, array, async_op):
            assert len(outputs) == group.size
            return (yield)
    """


@hookspec(firstresult=True)
def pluribus_reduce_scatter(
    group: ProcessGroup, output: Any, inputs: list[Any], op: ReduceOp, async_op: bool
) -> Work:
    """Reduce ``inputs[i]`` across the group into ``output`` on rank ``i``.

    Example::

        @hookimpl(wrapper=True)
        def pluribus_reduce_scatter(group, output, inputs, op, async_op):
            log.debug("reduce_scatter %s", output.shape)
            return (yield)
    """


@hookspec(firstresult=True)
def pluribus_all_to_all(
    group: ProcessGroup, outputs: list[Any], inputs: list[Any], async_op: bool
) -> Work:
    """Send ``inputs[j]`` to rank ``j`` and receive rank ``j``'s into ``outputs[j]``.

    Example::

        @hookimpl(wrapper=True)
        def pluribus_all_to_all(group, outputs, inputs, async_op):
            sent = sum(x.nbytes for x in inputs)
            return (yield)
    """


@hookspec(firstresult=True)
def pluribus_gather(
    group: ProcessGroup, array: Any, outputs: list[Any] | None, dst: int, async_op: bool
) -> Work:
    """Gather every rank's ``array`` into ``outputs`` on rank ``dst`` (``None`` elsewhere).

    Example::

        @hookimpl(wrapper=True)
        def pluribus_gather(group, array, outputs, dst, async_op):
            return (yield)
    """


@hookspec(firstresult=True)
def pluribus_scatter(
    group: ProcessGroup, array: Any, inputs: list[Any] | None, src: int, async_op: bool
) -> Work:
    """Copy ``inputs[i]`` of rank ``src`` into ``array`` on rank ``i``.

    Example::

        @hookimpl(wrapper=True)
        def pluribus_scatter(group, array, inputs, src, async_op):
            return (yield)
    """


@hookspec(firstresult=True)
def pluribus_barrier(group: ProcessGroup, async_op: bool) -> Work:
    """Return once every rank of the group has entered the barrier.

    Example::

        @hookimpl(wrapper=True)
        def pluribus_barrier(group, async_op):
            t = time.perf_counter()
            work = yield
            print("barrier took", time.perf_counter() - t)
            return work
    """


@hookspec(firstresult=True)
def pluribus_send(group: ProcessGroup, array: Any, dst: int, tag: int, async_op: bool) -> Work:
    """Send ``array`` to rank ``dst`` with ``tag``.

    Example::

        @hookimpl(wrapper=True)
        def pluribus_send(group, array, dst, tag, async_op):
            return (yield)
    """


@hookspec(firstresult=True)
def pluribus_recv(group: ProcessGroup, array: Any, src: int, tag: int, async_op: bool) -> Work:
    """Receive into ``array`` from rank ``src`` with ``tag``.

    Example::

        @hookimpl(wrapper=True)
        def pluribus_recv(group, array, src, tag, async_op):
            return (yield)
    """


# -- the hooks above against the one table of operations --------------------------------------


def _check_against_table() -> None:
    """Every operation hook takes ``group``, the table's arguments in order, and ``async_op``."""
    for op in OPERATIONS.values():
        code = globals()[op.hook_name].__code__
        names = code.co_varnames[: code.co_argcount]
        if names != ("group", *op.args, "async_op"):
            raise AssertionError(f"hook {op.hook_name}{names} disagrees with OPERATIONS: {op}")


_check_against_table()
