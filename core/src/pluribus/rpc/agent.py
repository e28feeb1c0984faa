"""A worker's RPC agent: who the workers are, the calls it makes, its references, leaving.

Each worker listens on one port (published in the job's store with its name) and opens one
connection to each peer it calls, on first use (``channel.Channel``); each peer that calls it
gets a ``server.ServerConnection``. The agent holds both kinds, encodes and decodes values with
their RRefs' counts, times out calls, and runs the graceful shutdown.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import json
import math
import os
import queue
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from ..errors import DistTimeoutError, PeerError, PluribusError
from . import segments, wire
from .channel import Channel
from .errors import LEFT, RemoteError
from .futures import Future, Reply
from .pool import HandlerPool
from .rref import OwnerTable, RRef
from .server import INLINE_LIMIT, ServerConnection
from .transport import Listener, connect


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's name and id (its rank), as torch.distributed.rpc has them."""

    name: str
    id: int


class Agent:
    """The RPC state of one worker (see the module's docstring)."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        store,
        secret: str,
        timeout: float,
        num_worker_threads: int,
        max_threads: int,
        max_message: int,
        address: str,
        bind_thread=None,
        shared_memory: bool = True,
    ):
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.who = f"worker {name!r} (rank {rank})"
        self.thread_prefix = f"pluribus-rpc-{name}"
        self.timeout = timeout
        self.max_message = max_message
        self.store = store
        self.secret = secret
        self.table = OwnerTable(self.who)
        self.workers: list[WorkerInfo] = []
        self._by_name: dict[str, WorkerInfo] = {}
        self._limits: dict[int, int] = {}
        self._addresses: dict[int, tuple[str, int]] = {}
        self._local: dict[int, bool] = {}  # whose listeners have a local name too
        self._probe = segments.Probe() if shared_memory else None
        self._pids: dict[int, int] = {}
        self._segments_from: set[int] = set()  # peers whose segments this worker can open
        self._segments_to: set[int] = set()  # peers that can open this worker's segments
        self.segment_pool = segments.SegmentPool()
        self._mapped = segments.MappedSegments()
        self._call_ids = itertools.count(1)
        self._rref_ids = itertools.count(1)
        self._state = "running"
        self._lock = threading.Lock()
        self._channels: dict[int, Channel] = {}
        self._connecting: dict[int, threading.Lock] = {}
        self._gone: dict[int, str] = {}
        self._connections: set[ServerConnection] = set()
        self._deadlines: list[tuple] = []  # (deadline, call id, seconds, future, channel, ...)
        self._deadline_cond = threading.Condition()
        self._releases: queue.SimpleQueue = queue.SimpleQueue()
        self.owns_store = False
        self.bind_thread = bind_thread  # makes this the agent of a thread that runs handlers
        self.pool = HandlerPool(
            num_worker_threads,
            max_threads,
            self.thread_prefix,
            on_thread_start=(lambda: bind_thread(self)) if bind_thread else None,
        )
        self._listener = Listener(address, secret, world_size, self._accepted, self.who)
        self._threads = [
            threading.Thread(target=target, name=f"{self.thread_prefix}-{what}", daemon=True)
            for target, what in (
                (self._watch_deadlines, "deadlines"),
                (self._release_loop, "gc"),
                (self._watch_inline, "inline"),
            )
        ]
        for thread in self._threads:
            thread.start()

    # -- joining the job ---------------------------------------------------------------------

    def join(self, deadline: float) -> None:
        """Publish this worker's name and address, then learn every other worker's."""
        me = {
            "name": self.name,
            "host": self._listener.host,
            "port": self._listener.port,
            "local": self._listener.local,
            "max_message": self.max_message,
            "pid": os.getpid(),
            "segments": self._probe.describe() if self._probe else None,
        }
        self.store.set(f"rpc/worker/{self.rank}", json.dumps(me))
        entries = []
        for rank in range(self.world_size):
            left = max(0.1, deadline - time.monotonic())
            try:
                raw = self.store.get(f"rpc/worker/{rank}", left)
            except DistTimeoutError:
                raise DistTimeoutError(
                    f"{self.who}: rank {rank} did not call init_rpc within the timeout; start "
                    f"all {self.world_size} workers (world_size={self.world_size})"
                ) from None
            entry = json.loads(raw)
            entries.append(entry)
            info = WorkerInfo(str(entry["name"]), rank)
            if info.name in self._by_name:
                other = self._by_name[info.name].id
                raise ValueError(
                    f"{self.who}: ranks {other} and {rank} both call themselves {info.name!r}; "
                    "every worker needs its own name"
                )
            self.workers.append(info)
            self._by_name[info.name] = info
            self._addresses[rank] = (str(entry["host"]), int(entry["port"]))
            self._local[rank] = entry.get("local") is True
            self._limits[rank] = int(entry["max_message"])
        self._join_segments(entries, deadline)

    def _join_segments(self, entries: list[dict], deadline: float) -> None:
        """Find which peers share this host's memory with this worker, both ways: each worker
        probes the others' published segments and publishes whose it could open."""
        if self._probe is None:
            return
        for rank, entry in enumerate(entries):
            if isinstance(entry.get("pid"), int) and segments.can_read(entry.get("segments")):
                self._pids[rank] = entry["pid"]
                self._segments_from.add(rank)
        self.store.set(f"rpc/segments/{self.rank}", json.dumps(sorted(self._segments_from)))
        for rank in range(self.world_size):
            try:
                readers = json.loads(
                    self.store.get(f"rpc/segments/{rank}", max(0.1, deadline - time.monotonic()))
                )
            except DistTimeoutError:
                continue  # that peer gets TCP only
            if self.rank in readers:
                self._segments_to.add(rank)

    def lend_segment(
        self, pieces: list, size: int, peer: int, wait: bool = False
    ) -> tuple[int, int, int] | None:
        """(fd, segment id, serial) of a segment holding a frame's heap for ``peer``; None:
        TCP carries it (a small heap, a peer on another host, or no memory for segments)."""
        if size < segments.SEGMENT_MIN or peer not in self._segments_to:
            return None
        try:
            return self.segment_pool.lend(pieces, size, peer, wait)
        except OSError:
            return None

    def open_segment(self, sender: int, fd: int, segment_id: int, serial: int, size: int):
        """The heap of a frame from ``sender`` that came in its segment ``fd``; the segment
        goes back to ``sender`` when the last array viewing it is gone."""
        if sender not in self._segments_from:
            raise segments.SegmentError(
                f"{self.who}: rank {sender} sent a shared-memory segment but did not prove at "
                "start-up that it shares this host's memory"
            )
        heap = self._mapped.heap(sender, self._pids[sender], fd, segment_id, size)
        weakref.finalize(heap, self._releases.put, (self._segment_free, sender, serial))
        return heap

    def _segment_free(self, sender: int, serial: int) -> None:
        if sender == self.rank:
            self.segment_pool.give_back(serial, self.rank)
            return
        if self._state == "closed":
            return  # the sender closes its segments when it sees this worker leave
        try:
            body = wire.encode_body({"op": "segment-free", "serial": serial}, self.who)
            self._channel(self.workers[sender], self.timeout).send(wire.NOTE, 0, body)
        except PluribusError:
            pass  # the sender is gone, and its segments with it

    # -- whom to call ------------------------------------------------------------------------

    def worker(self, to: Any) -> WorkerInfo:
        """The worker ``to`` names (a name, a rank or a WorkerInfo), or a ValueError."""
        if isinstance(to, WorkerInfo):
            to = to.name
        if isinstance(to, str):
            info = self._by_name.get(to)
            if info is not None:
                return info
        elif isinstance(to, int) and not isinstance(to, bool) and 0 <= to < len(self.workers):
            return self.workers[to]
        names = ", ".join(repr(w.name) for w in self.workers)
        raise ValueError(f"{self.who}: there is no worker {to!r}; the workers are {names}")

    def check_running(self, what: str) -> None:
        if self._state == "closed":
            raise PluribusError(
                f"{self.who}: {what} after rpc.shutdown(); call init_rpc to start again"
            )

    def timeout_of(self, timeout: float | None) -> float:
        if timeout is None:
            return self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"{self.who}: timeout must be seconds, got {timeout!r}")
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(
                f"{self.who}: timeout must be a positive number of seconds, got {timeout!r}; "
                "every call has one"
            )
        return float(timeout)

    def gone_error(self, peer: WorkerInfo, reason: str, pending: bool = False) -> PeerError:
        what = "with this call pending" if pending else ""
        return PeerError(
            f"{self.who}: worker {peer.name!r} (rank {peer.id}) {reason} {what}".rstrip()
            + ("" if reason.startswith(LEFT) else "; its calls cannot complete"),
            peer=peer.id,
        )

    def peer_gone(self, rank: int, reason: str | None) -> None:
        with self._lock:
            if reason is not None and rank not in self._gone and rank != self.rank:
                self._gone[rank] = reason
        if rank != self.rank:
            self.segment_pool.forget_peer(rank)
            self._mapped.forget(rank)

    def _channel(self, peer: WorkerInfo, timeout: float) -> Channel:
        channel = self._channels.get(peer.id)
        if channel is not None and channel.broken is None:
            return channel
        with self._lock:
            lock = self._connecting.setdefault(peer.id, threading.Lock())
        with lock:
            channel = self._channels.get(peer.id)
            if channel is not None and channel.broken is None:
                return channel
            if channel is not None or peer.id in self._gone:
                raise self.gone_error(peer, self._gone.get(peer.id) or channel.broken)
            host, port = self._addresses[peer.id]
            try:
                sock = connect(
                    host,
                    port,
                    self.secret,
                    self.rank,
                    timeout,
                    f"worker {peer.name!r}",
                    self._local.get(peer.id, False),
                )
            except PeerError as exc:
                self.peer_gone(peer.id, "cannot be reached (it died or shut down)")
                raise PeerError(
                    f"{self.who}: worker {peer.name!r} (rank {peer.id}) cannot be reached; it "
                    f"died or shut down ({exc})",
                    peer=peer.id,
                ) from None
            channel = Channel(self, peer, sock)
            self._channels[peer.id] = channel
            if self._state == "closed":
                channel.close(LEFT)
                self.check_running("a call")
            return channel

    # -- calls out ---------------------------------------------------------------------------

    def call_function(
        self,
        to: Any,
        name: str,
        args: tuple,
        kwargs: dict,
        timeout: float | None,
        what: str,
        wait: bool,
    ) -> Future | Any:
        """Run the exposed function ``name`` on ``to``: as a ``CALL`` frame when its arguments
        are plain (no codec on either side), else as a request; its Future or its result."""
        seconds = self.timeout_of(timeout)
        description = wire.encode_call(name, args, kwargs, seconds)
        if description is None:
            request = {"op": "call", "fn": name, "args": args, "kwargs": kwargs}
            return self.call(to, request, seconds, what, wait)
        return self.call(to, None, seconds, what, wait, (description, ()))

    def call(
        self,
        to: Any,
        request: dict | None,
        timeout: float | None,
        what: str,
        wait: bool,
        plain_call: tuple | None = None,
    ) -> Future | Any:
        """Send ``request`` to ``to`` (or the ``CALL`` frame body ``plain_call``); its Future
        (``wait=False``) or its result."""
        self.check_running(what)
        peer = self.worker(to)
        seconds = self.timeout_of(timeout)
        if plain_call is None:
            request["timeout"] = seconds
            kind, body = wire.REQUEST, self.encode(request, peer.id, True, f"{self.who}: {what}")
            limit = self._limits.get(peer.id, wire.DEFAULT_MAX_MESSAGE)
            size = sum(p.nbytes for p in body[1])
            if size > limit:
                self._undo_counts(body)
                raise ValueError(
                    f"{self.who}: {what} carries {size} bytes of arrays, more than worker "
                    f"{peer.name!r} accepts ({limit}; its init_rpc max_message_bytes)"
                )
        else:
            kind, body = wire.CALL, plain_call
        future = Reply() if wait else Future()
        call_id = next(self._call_ids)
        try:
            channel = self._channel(peer, seconds)
            channel.send(kind, call_id, body, future)
        except BaseException:
            self._undo_counts(body)
            raise
        if wait:
            if not channel.wait(future, time.monotonic() + seconds):
                channel.pending.pop(call_id, None)
                channel.want_reader()  # the late reply must still be read off the connection
                raise self._timed_out(what, peer, seconds)
            return future.result()
        channel.want_reader()
        with self._deadline_cond:
            heapq.heappush(
                self._deadlines,
                (time.monotonic() + seconds, call_id, seconds, future, channel, what, peer),
            )
            if self._deadlines[0][1] == call_id:
                self._deadline_cond.notify()
        return future

    def _timed_out(self, what: str, peer: WorkerInfo, seconds: float) -> DistTimeoutError:
        return DistTimeoutError(
            f"{self.who}: {what} on worker {peer.name!r} did not finish within {seconds:.3g}s; "
            "pass a larger timeout= if it is expected to take longer"
        )

    def _watch_deadlines(self) -> None:
        with self._deadline_cond:
            while self._state != "closed":
                if not self._deadlines:
                    self._deadline_cond.wait()
                    continue
                due = self._deadlines[0][0] - time.monotonic()
                if due > 0:
                    self._deadline_cond.wait(due)
                    continue
                _, call_id, seconds, future, channel, what, peer = heapq.heappop(self._deadlines)
                if channel.pending.pop(call_id, None) is not None and not future.done():
                    future.set_exception(self._timed_out(what, peer, seconds))

    def _watch_inline(self) -> None:
        """Hand reading over from a handler that runs long on a connection's reading thread,
        so that the peer's next calls are not held up behind it."""
        while self._state != "closed":
            time.sleep(INLINE_LIMIT / 2)
            now = time.monotonic()
            for connection in list(self._connections):
                run = connection.inline_run
                if run is not None and now - run[1] > INLINE_LIMIT:
                    connection.hand_over(run)

    def deliver(self, future: Future, reply: Any, peer: WorkerInfo) -> None:
        if isinstance(reply, dict) and "ok" in reply:
            future.set_result(reply["ok"])
        elif isinstance(reply, dict) and isinstance(reply.get("error"), list):
            kind, message, trace = (str(x) for x in reply["error"][:3])
            future.set_exception(RemoteError(peer.name, kind, message, trace))
        else:
            future.set_exception(PluribusError(f"{self.who}: a bad reply from {peer.name!r}"))

    # -- remote references ---------------------------------------------------------------------

    def new_rref_id(self) -> str:
        return f"{self.rank}.{next(self._rref_ids)}"

    def remote(self, to: Any, name: str, args, kwargs, timeout) -> RRef:
        peer = self.worker(to)
        rid = self._new_owned_id(peer.id)
        request = {"op": "remote", "fn": name, "rref": rid, "args": args, "kwargs": kwargs}
        future = self.call(peer, request, timeout, f"remote({name})", wait=False)
        return RRef._handle(self, peer.id, rid, future)

    def _new_owned_id(self, owner: int) -> str:
        """A fresh RRef id. Made on this worker for itself, the entry exists before the call
        goes out, so the handle can be passed on at once; an owner elsewhere makes it when it
        reads the call, before anything the handle is later sent with."""
        rid = self.new_rref_id()
        if owner == self.rank:
            self.table.create(rid)
        return rid

    def fetch(self, rref: RRef, timeout: float | None) -> Any:
        request = {"op": "fetch", "rref": rref.id}
        return self.call(rref._owner, request, timeout, f"to_here() of {rref.id}", wait=True)

    def call_method(self, rref: RRef, method: str, args, kwargs, mode: str, timeout) -> Any:
        rref._check_usable(f"rpc_{mode}().{method}")
        request = {"op": "method", "rref": rref.id, "method": method, "args": args}
        request["kwargs"] = kwargs
        what = f"{method}() of {rref.id}"
        if mode == "remote":
            rid = self._new_owned_id(rref._owner)
            request["into"] = rid
            future = self.call(rref._owner, request, timeout, what, wait=False)
            return RRef._handle(self, rref._owner, rid, future)
        return self.call(rref._owner, request, timeout, what, wait=mode == "sync")

    def release(self, owner: int, rid: str) -> None:
        if owner == self.rank:
            self.table.decref(rid)
            return
        if self._state == "closed":
            return
        try:
            peer = self.workers[owner]
            body = wire.encode_body({"op": "decref", "rref": rid}, self.who)
            self._channel(peer, self.timeout).send(wire.NOTE, 0, body)
        except PluribusError:
            pass  # the owner is gone, and its values with it

    def release_later(self, owner: int, rid: str) -> None:
        """From a garbage-collected handle: any thread, holding any lock."""
        self._releases.put((self.release, owner, rid))

    def _release_loop(self) -> None:
        while True:
            item = self._releases.get()
            if item is None:
                return
            item[0](*item[1:])

    def _add_count(self, owner: int, rid: str) -> None:
        if owner == self.rank:
            self.table.incref(rid)
        else:
            self.call(owner, {"op": "incref", "rref": rid}, None, f"passing RRef {rid}", True)

    def _undo_counts(self, body) -> None:
        for owner, rid in getattr(body, "counted", ()):
            self.release(owner, rid)

    # -- encoding, with RRefs ------------------------------------------------------------------

    def encode(self, value: Any, dest: int, request: bool, who: str, root: str = "the call"):
        """The frame body of ``value`` for worker ``dest``. An RRef in it gets a count for the
        handle the receiver will make (see :mod:`pluribus.rpc.rref`)."""
        counted: list[tuple[int, str]] = []

        def rref_body(item: Any):
            if not isinstance(item, RRef):
                return None
            item._check_usable("sending")
            if item._agent is not self:
                raise TypeError(f"{who}: {item!r} belongs to another RPC agent")
            if not (request and dest == item._owner and dest != self.rank):
                self._add_count(item._owner, item.id)
                counted.append((item._owner, item.id))
            return ["rref", item._owner, item.id]

        try:
            description, pieces = wire.encode_body(value, who, rref_body, root)
        except BaseException:
            for owner, rid in counted:
                self.release(owner, rid)
            raise
        return _Body(description, pieces, counted)

    def decode(self, description: bytes, heap, sender: int, request: bool) -> Any:
        made: list[RRef] = []

        def rref_of(body: Any) -> RRef:
            if not (
                isinstance(body, list)
                and len(body) == 3
                and body[0] == "rref"
                and isinstance(body[1], int)
                and 0 <= body[1] < self.world_size
                and isinstance(body[2], str)
                and len(body[2]) <= 64
            ):
                raise ValueError("a malformed RRef")
            owner, rid = body[1], body[2]
            if request and owner == self.rank and sender != self.rank:
                self.table.incref(rid)
            handle = RRef._handle(self, owner, rid)
            made.append(handle)
            return handle

        try:
            return wire.decode_body(description, heap, rref_of)
        except BaseException:
            for handle in made:
                handle.release()
            raise

    # -- calls in ------------------------------------------------------------------------------

    def _accepted(self, sock: socket.socket, peer: int) -> None:
        if self._state == "closed":
            sock.close()
            return
        connection = ServerConnection(self, sock, peer)
        with self._lock:
            self._connections.add(connection)
        connection.start()

    def forget_connection(self, connection: ServerConnection) -> None:
        with self._lock:
            self._connections.discard(connection)

    # -- leaving -------------------------------------------------------------------------------

    def shutdown(self, graceful: bool, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if graceful and self._state == "running":
            self._state = "draining"
            self._wait_own_calls(deadline)
            self._barrier(deadline)
            self.pool.drain(deadline)
        self._close()

    def _wait_own_calls(self, deadline: float) -> None:
        calls = [f for channel in list(self._channels.values()) for f in channel.pending.values()]
        for call in calls:
            left = max(0.0, deadline - time.monotonic())
            if isinstance(call, Reply):
                call.wait(left)
            else:
                concurrent.futures.wait([call], timeout=left)

    def _barrier(self, deadline: float) -> None:
        """Wait until every other worker has come to shutdown too (or is gone), so that none
        calls this one after it left: torch's graceful shutdown, bounded by the deadline."""
        try:
            self.store.set(f"rpc/done/{self.rank}", b"1")
        except Exception:
            return
        waiting_for = set(range(self.world_size)) - {self.rank}
        next_probe = time.monotonic() + 0.5
        while waiting_for and time.monotonic() < deadline:
            try:
                waiting_for = {r for r in waiting_for if not self.store.check([f"rpc/done/{r}"])}
            except Exception:
                return  # the store left with the worker that served it: everyone is done
            waiting_for -= set(self._gone)
            if waiting_for and time.monotonic() >= next_probe:
                for rank in list(waiting_for):  # a dead worker refuses connections
                    try:
                        self._channel(self.workers[rank], 1.0)
                    except PluribusError:
                        waiting_for.discard(rank)
                next_probe = time.monotonic() + 0.5
            time.sleep(0.02)

    def _close(self) -> None:
        with self._lock:
            if self._state == "closed":
                return
            self._state = "closed"
            channels = list(self._channels.values())
            connections = list(self._connections)
        self._listener.close()
        for connection in connections:
            connection.close(bye=True)
        for channel in channels:
            with channel.lock:
                try:
                    channel.sock.settimeout(1.0)
                    wire.send_frame(channel.sock, wire.BYE, 0)
                except OSError:
                    pass
            channel.close(LEFT)
        with self._deadline_cond:
            self._deadline_cond.notify_all()
        self._releases.put(None)
        self.pool.close()
        self.table.clear()
        self.segment_pool.close()
        self._mapped.forget()
        if self._probe is not None:
            self._probe.close()


class _Body(tuple):
    """(description, pieces) of an encoded value, with the counts added for its RRefs."""

    counted: list[tuple[int, str]]

    def __new__(cls, description: bytes, pieces: list, counted: list):
        body = super().__new__(cls, (description, pieces))
        body.counted = counted
        return body
