"""The class a backend plugin implements.

A backend is one rank's endpoint of a group of ``size`` ranks. ``send`` and ``recv`` are the
required minimum; the core runs every collective over them with generic algorithms
(``pluribus.algorithms``). A backend that has faster native collectives defines methods with the
names and signatures below (``all_reduce``, ``broadcast``, ...); the core calls a native method
when it exists and the generic algorithm otherwise. All ranks are group-local (0..size-1), all
arrays are contiguous and already validated by the core, and every method blocks until done.
"""

from __future__ import annotations

import queue
import threading
import zlib
from typing import Any

import numpy as np

from .errors import DistTimeoutError, PeerError
from .work import Work

# The tag budget: every tag pluribus puts on a message, by range, so that no two kinds of
# message ever match each other. A backend that carries fewer tag bits says so (max_tag) and is
# refused at group creation rather than failing in the middle of a job.
#: Users' send/recv: [0, 2**24).
USER_TAG_LIMIT = 1 << 24
#: Collectives (the core's generic ones, and a backend's native ones above it): [2**24, 2**25).
COLLECTIVE_TAG = USER_TAG_LIMIT
#: Added to the tags of the debug aids' own exchanges (PLURIBUS_DEBUG=DETAIL fingerprints).
DEBUG_TAG_SHIFT = 1 << 25
#: Every tag within one group is below this.
GROUP_TAG_LIMIT = 1 << 26
#: A sub-group carried over its parent's connections adds ``k << SUBGROUP_TAG_SHIFT``, with
#: 1 <= k <= SUBGROUP_SPACES.
SUBGROUP_TAG_SHIFT = 40
SUBGROUP_SPACES = 1 << 18
#: The largest tag the core may hand a backend.
MAX_TAG = (SUBGROUP_SPACES << SUBGROUP_TAG_SHIFT) | (GROUP_TAG_LIMIT - 1)


def check_tag_budget(backend: Backend, rank: int) -> None:
    """Refuse a backend that cannot carry every tag of the budget (at group creation)."""
    limit = getattr(backend, "max_tag", None)
    if limit is not None and limit < MAX_TAG:
        raise ValueError(
            f"rank {rank}: the {backend.name} backend carries tags up to {limit}, but pluribus "
            f"uses tags up to {MAX_TAG} (users' below 2**24, collectives below 2**25, the debug "
            f"aids' below 2**26, sub-group k adding k << {SUBGROUP_TAG_SHIFT}); the backend "
            "must map that range onto its own tags and declare max_tag accordingly"
        )


class Backend:
    """One rank's endpoint. Subclasses set ``name`` and implement ``send`` and ``recv``.

    ``send`` may block until the receiver takes the message (rendezvous semantics are allowed), so
    the generic algorithms exchange through ``sendrecv``, whose default runs the send on a helper
    thread. Messages between one pair of ranks with one tag arrive in the order they were sent.
    """

    name = "backend"
    #: The largest tag this backend can carry (None: any non-negative 64-bit tag); see the tag
    #: budget above.
    max_tag: int | None = None
    #: Whether this backend notices a dead peer itself and raises PeerError naming it (and
    #: honours its ``timeout`` in every wait). When False, the core watches the ranks through
    #: lifelines (:mod:`pluribus.lifeline`) and, when one fails, ends the waits of the store it
    #: gave the backend (``ctx.store``) and calls :meth:`abort`.
    detects_failures = False
    #: For a backend that leaves failures to the core: whether every call blocked in it ends
    #: once the core has done that, because it waits only on ``ctx.store`` or because its
    #: ``abort`` wakes its other waits. Then the core runs calls on the calling thread. Set it
    #: False when a call may block on something neither ends: the core then runs each call on
    #: the group's worker thread, which a failure or the group's timeout can abandon (a thread
    #: hand-off per call).
    abort_wakes_calls = True
    #: Whether ``send`` may wait for the receiver. When False, the default :meth:`sendrecv`
    #: sends before receiving on the calling thread.
    send_blocks = True
    _sender: _Sender | None = None
    #: Array devices this backend carries; a cupy array on a "cpu"-only backend is refused
    #: unless host staging was asked for.
    devices: tuple[str, ...] = ("cpu",)

    def __init__(self, rank: int, size: int, timeout: float = 300.0):
        self.rank = rank
        self.size = size
        self.timeout = timeout

    # -- required -----------------------------------------------------------------------------
    def send(self, array: Any, dst: int, tag: int = 0) -> None:
        """Send the contiguous ``array`` to rank ``dst``."""
        raise NotImplementedError

    def recv(self, array: Any, src: int, tag: int = 0) -> None:
        """Receive into the contiguous ``array`` from rank ``src``; the sizes match."""
        raise NotImplementedError

    # -- optional -----------------------------------------------------------------------------
    def sendrecv(self, send_array: Any, dst: int, recv_array: Any, src: int, tag: int = 0) -> None:
        """Send to ``dst`` and receive from ``src`` at once, so that rings cannot deadlock.

        Without :attr:`send_blocks` the send runs here first. With it, an exchange with one
        partner (``dst == src``, as in recursive doubling) runs here too, the lower rank sending
        first (two sends that wait for their receivers cannot meet); any other exchange runs its
        send on this backend's sender thread (one, started on first use) while this thread
        receives.
        """
        if dst == self.rank and src == self.rank:
            recv_array[...] = send_array
            return
        if not self.send_blocks:
            self.send(send_array, dst, tag)
            self.recv(recv_array, src, tag)
            return
        if dst == src:  # a thread hand-off costs more than the second message
            if self.rank < dst:
                self.send(send_array, dst, tag)
                self.recv(recv_array, src, tag)
            else:
                self.recv(recv_array, src, tag)
                self.send(send_array, dst, tag)
            return
        sender = self._sender
        if sender is None:
            sender = self._sender = _Sender(f"pluribus-sendrecv-{self.rank}")
        sent = sender.post(self.send, (send_array, dst, tag))
        self.recv(recv_array, src, tag)
        if not sent.wait(self.timeout):
            raise DistTimeoutError(
                f"rank {self.rank}: send to rank {dst} did not finish within {self.timeout:.0f}s"
            )
        if sent.error is not None:
            raise sent.error

    def start(self, name: str, args: tuple) -> Work | None:
        """Start operation ``name`` of :data:`~pluribus.operations.OPERATIONS` without waiting
        and return its Work, or None to let the core run the blocking method on the group's
        worker thread (the default).

        ``args`` are the operation's arguments in the table's order. The core calls this for
        ``async_op=True`` when nothing is queued before the call on the group, so a backend
        whose transport keeps issue order itself (MPI requests, CUDA streams) returns its own
        Work for the request in flight. The Work's ``wait`` raises the operation's error.
        """
        return None

    def unsupported(self, dtype: Any, op: Any) -> str | None:
        """Why this backend cannot reduce ``dtype`` arrays with ``op`` (a sentence the core
        puts in a TypeError naming the rank), or None when it can. Asked once per dtype and op
        on a group, before anything is sent; the default supports everything the core does."""
        return None

    def new_subgroup(self, ranks: list[int], ctx: Any) -> Backend:
        """Return a backend for the group of the given group-local ``ranks`` (this rank is in it).

        ``ctx`` is a :class:`~pluribus.types.BackendContext` for the new group, with a store of its
        own. The default reuses this backend's connections through a view that renumbers ranks
        and shifts tags; backends with native communicators (MPI, NCCL) return a real one.
        """
        shift = subgroup_tag_shift(ctx.group_name)
        return SubgroupView(self, ranks, ctx.rank, shift, ctx.timeout)

    def empty_symmetric(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """A numpy array every rank of the group allocates with this call, placed where this
        backend's collectives can read it on every peer without a copy (symmetric memory; see
        :func:`pluribus.empty_symmetric`, which checked that every rank passes the same shape
        and dtype and calls this in the group's collective order). The default, for backends
        that cannot, is a plain ``np.empty``."""
        return np.empty(shape, dtype)

    def abort(self, reason: str) -> None:
        """Stop every blocking call on this rank as soon as possible (after a failure)."""

    def close(self) -> None:
        """Release connections, segments and threads. Called once, on destroy."""

    def end_sendrecv_waits(self, error: BaseException) -> None:
        """End the waits of :meth:`sendrecv` for sends on the sender thread with ``error`` (the
        core calls this with :meth:`abort` after a failure; the sends may stay stuck)."""
        if self._sender is not None:
            self._sender.fail(error)


class _Sent(threading.Event):
    error: BaseException | None = None


class _Sender:
    """One thread that runs a backend's sends for ``sendrecv``, one after another."""

    def __init__(self, name: str):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.posted: set[_Sent] = set()
        self.failure: BaseException | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def post(self, send, args: tuple) -> _Sent:
        done = _Sent()
        if self.failure is not None:
            done.error = self.failure
            done.set()
            return done
        self.posted.add(done)
        self.queue.put((send, args, done))
        return done

    def fail(self, error: BaseException) -> None:
        self.failure = error
        for done in list(self.posted):
            if not done.is_set():
                done.error = error
                done.set()

    def _run(self) -> None:
        while True:
            send, args, done = self.queue.get()
            try:
                send(*args)
            except BaseException as exc:  # reported on the calling thread
                if done.error is None:
                    done.error = exc
            self.posted.discard(done)
            done.set()


def subgroup_tag_shift(group_name: str) -> int:
    """The tag offset of a sub-group: derived from its name, which every rank agrees on (ranks
    outside a group never see it created, so a per-process counter would disagree)."""
    return ((zlib.crc32(group_name.encode()) % SUBGROUP_SPACES) + 1) << SUBGROUP_TAG_SHIFT


class SubgroupView(Backend):
    """A sub-group carried over its parent's connections: ranks renumbered, tags shifted."""

    def __init__(
        self, parent: Backend, ranks: list[int], rank: int, tag_shift: int, timeout: float
    ):
        super().__init__(rank, len(ranks), timeout)
        self.parent = parent
        # The parent's waits last the parent's timeout: a shorter one here is the core's to
        # enforce, as is failure detection when the parent leaves it to the core.
        self.detects_failures = parent.detects_failures and parent.timeout <= timeout
        self.abort_wakes_calls = parent.abort_wakes_calls and parent.timeout <= timeout
        self.send_blocks = parent.send_blocks
        self.parent_ranks = list(ranks)
        self.tag_shift = tag_shift
        self.name = parent.name
        self.devices = parent.devices

    def send(self, array: Any, dst: int, tag: int = 0) -> None:
        self.parent.send(array, self.parent_ranks[dst], tag + self.tag_shift)

    def recv(self, array: Any, src: int, tag: int = 0) -> None:
        try:
            self.parent.recv(array, self.parent_ranks[src], tag + self.tag_shift)
        except PeerError as exc:
            raise PeerError(f"{exc} (sub-group rank {src})", exc.peer) from exc

    def sendrecv(self, send_array: Any, dst: int, recv_array: Any, src: int, tag: int = 0) -> None:
        self.parent.sendrecv(
            send_array,
            self.parent_ranks[dst],
            recv_array,
            self.parent_ranks[src],
            tag + self.tag_shift,
        )

    def new_subgroup(self, ranks: list[int], ctx: Any) -> Backend:
        return self.parent.new_subgroup([self.parent_ranks[r] for r in ranks], ctx)
