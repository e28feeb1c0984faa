"""A worker's RPC agent: its listener, its connections, the calls it makes and serves.

Each worker listens on one port (published in the job's store with its name) and opens one
connection to each peer it calls, on first use. On a connection the caller sends requests and
notes (reference releases) and reads replies on a reader thread; the callee reads them on a
thread of its own per connection, answers reference bookkeeping there at once, and runs handlers
on the bounded pool. A connection that ends without a goodbye means its peer died: every call
pending on it fails at once with an error naming the worker, and so does every later call.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import json
import math
import queue
import select
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from ..errors import DistTimeoutError, PeerError, PluribusError
from . import registry, wire
from .errors import RemoteError
from .futures import Future
from .pool import HandlerPool, current_pool, waiting
from .rref import OwnerTable, RRef
from .transport import Listener, connect

#: A handler run on a connection's reading thread longer than this (seconds) hands reading on.
INLINE_LIMIT = 0.02
_DIED = "died (its connection closed without a goodbye: the process exited or was killed)"
_LEFT = "shut down"


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's name and id (its rank), as torch.distributed.rpc has them."""

    name: str
    id: int


class _Channel:
    """This worker's connection to one peer's server: requests and notes out, replies in.

    Whoever waits reads: a thread waiting in ``rpc_sync`` reads the replies itself (and hands
    on the others' replies it meets), so a small call costs no hand-over between threads. The
    channel's own reader thread reads only for calls nobody is reading for (``rpc_async``, or
    callers left waiting when a reader's reply came first).
    """

    def __init__(self, agent: Agent, peer: WorkerInfo, sock: socket.socket):
        self.agent = agent
        self.peer = peer
        self.sock = sock
        self.lock = threading.Lock()  # sending
        self.pending: dict[int, Future] = {}
        self.broken: str | None = None
        self._said_bye = False
        self._reader = wire.FrameReader(sock, agent.max_message)
        self._role = threading.Lock()  # reading
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._requests_sent = 0  # written under ``lock``
        self._replies_read = 0  # written by the thread holding ``_role``
        self._wanted = threading.Condition()
        self._reader_wanted = False
        threading.Thread(
            target=self._read_for_others, name=f"{agent.thread_prefix}-to-{peer.name}", daemon=True
        ).start()

    def send(self, kind: int, call_id: int, body, future: Future | None = None) -> None:
        """Write a frame; with ``future``, a request whose reply it receives. The channel's
        reader thread is woken for it unless the caller reads itself (``wait``)."""
        description, pieces = body
        if self.owed() and sum(p.nbytes for p in pieces) > 65536:
            # someone must read replies while this thread may block sending: a peer blocked
            # sending a large reply is not reading this request
            self.want_reader()
        with self.lock:
            if self.broken is not None:
                raise self.agent.gone_error(self.peer, self.broken)
            if future is not None:
                self.pending[call_id] = future
            try:
                wire.send_frame(self.sock, kind, call_id, description, pieces)
                if kind == wire.REQUEST:
                    self._requests_sent += 1
            except OSError as exc:
                self.pending.pop(call_id, None)
                self.broken = _DIED
                raise self.agent.gone_error(self.peer, f"{_DIED}: {exc}") from None

    def owed(self) -> int:
        """Replies the peer still owes, including those of calls that timed out here."""
        return max(0, self._requests_sent - self._replies_read)

    def want_reader(self) -> None:
        with self._wanted:
            self._reader_wanted = True
            self._wanted.notify()

    def wait(self, future: Future, deadline: float) -> bool:
        """Read until ``future`` is done or ``deadline`` passes; False on the deadline."""
        if current_pool() is None:
            return self._wait(future, deadline)
        with waiting():  # a handler waiting: its pool may run another meanwhile
            return self._wait(future, deadline)

    def _wait(self, future: Future, deadline: float) -> bool:
        while not future.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not self._role.acquire(blocking=False):
                try:  # another thread reads, and will hand the reply on
                    future.exception(min(left, 0.05))
                except concurrent.futures.TimeoutError:
                    pass
                continue
            try:
                while not future.done() and self.broken is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if not self._reader.buffered() and not self._poll.poll(left * 1000):
                        continue
                    self._read_one()
            finally:
                self._role.release()
                if self.owed():
                    self.want_reader()
        return True

    def _read_for_others(self) -> None:
        while self.broken is None:
            with self._wanted:
                while not self._reader_wanted and self.broken is None:
                    self._wanted.wait()
                self._reader_wanted = False
            while self.owed() and self.broken is None:
                with self._role:
                    if self.owed() and self.broken is None:
                        self._read_one()

    def _read_one(self) -> None:
        """Read one frame and hand its reply to its future; close the channel at its end."""
        try:
            frame = self._reader.read()
            if frame is None:
                self.close(_LEFT if self._said_bye else _DIED)
                return
            kind, call_id, description, heap = frame
            if kind == wire.BYE:
                self._said_bye = True
                return
            if kind != wire.REPLY:
                raise wire.FrameError(f"a frame of kind {kind} where replies come")
            self._replies_read += 1
        except (OSError, ValueError) as exc:
            self.close(_LEFT if self._said_bye else f"{_DIED}: {exc}")
            return
        future = self.pending.pop(call_id, None)
        if future is None:  # timed out meanwhile
            return
        try:
            reply = self.agent.decode(description, heap, self.peer.id, request=False)
        except Exception as exc:
            future.set_exception(
                PluribusError(f"{self.agent.who}: a bad reply from {self.peer.name!r}: {exc}")
            )
            return
        self.agent.deliver(future, reply, self.peer)

    def close(self, reason: str) -> None:
        with self.lock:
            if self.broken is None:
                self.broken = reason
            pending, self.pending = self.pending, {}
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._wanted:
            self._wanted.notify_all()
        self.agent.peer_gone(self.peer.id, self.broken)
        error = self.agent.gone_error(self.peer, self.broken, pending=True)
        for future in pending.values():
            if not future.done():
                future.set_exception(error)


class _ServerConnection:
    """One peer's connection to this worker's server: requests and notes in, replies out."""

    def __init__(self, agent: Agent, sock: socket.socket, peer: int):
        self.agent = agent
        self.sock = sock
        self.peer = peer
        self.lock = threading.Lock()
        self.closed = False
        self.name = agent.workers[peer].name if peer < len(agent.workers) else str(peer)
        self._reader = wire.FrameReader(sock, agent.max_message)
        self._role = threading.Lock()
        self._readers = itertools.count()
        self._reading = next(self._readers)  # which thread reads now

    def start(self, token: int = 0) -> None:
        """Start reading (one thread at a time reads; see ``run_inline``)."""
        threading.Thread(
            target=self._serve,
            args=(token,),
            name=f"{self.agent.thread_prefix}-from-{self.name}",
            daemon=True,
        ).start()

    def run_inline(self, job, token: int) -> bool:
        """Run a handler on the reading thread ``token``, saving the hand-over to a pool thread
        (the round trip of a small call). Reading goes on in another thread if the handler
        waits for a call or outlives ``INLINE_LIMIT``. False when the pool is full."""
        run = (self, token)
        self.agent.inline[run] = time.monotonic()
        try:
            return self.agent.pool.run_here(job, lambda: self.hand_over(token))
        finally:
            self.agent.inline.pop(run, None)

    def hand_over(self, token: int) -> None:
        """If thread ``token`` still reads this connection, let a new thread read instead."""
        with self._role:
            if self._reading != token:
                return
            self._reading = next(self._readers)
            successor = self._reading
        self.start(successor)

    def _still_reader(self, token: int) -> bool:
        with self._role:
            return self._reading == token

    def _serve(self, token: int) -> None:
        if self.agent.bind_thread is not None:
            self.agent.bind_thread(self.agent)
        said_bye = False
        reader = self._reader
        try:
            while True:
                try:
                    frame = reader.read()
                except wire.FrameError as exc:
                    # the stream cannot be followed past a bad header: say why, then hang up
                    self.reply_error(0, exc)
                    break
                if frame is None:
                    break
                kind, call_id, description, heap = frame
                if kind == wire.BYE:
                    said_bye = True
                    continue
                try:
                    body = self.agent.decode(description, heap, self.peer, request=True)
                except Exception as exc:
                    if kind == wire.REQUEST:
                        self.reply_error(call_id, exc)
                    continue
                if kind == wire.REQUEST:
                    self.agent.serve(self, call_id, body, token)
                    if not self._still_reader(token):
                        return  # another thread reads on; this one ran a handler
                elif kind == wire.NOTE:
                    self.agent.note(body)
        except OSError:
            pass
        self.close()
        if not said_bye:
            self.agent.peer_gone(self.peer, _DIED)

    def reply(self, call_id: int, value: Any) -> None:
        try:
            body = self.agent.encode(
                {"ok": value}, self.peer, request=False, who=self.agent.who, root="the reply"
            )
        except Exception as exc:
            self.reply_error(call_id, exc)
            return
        self._send(wire.REPLY, call_id, body)

    def reply_error(self, call_id: int, exc: BaseException) -> None:
        trace = "".join(traceback.format_exception(exc)) if exc.__traceback__ else ""
        self.reply_remote_error(call_id, (type(exc).__qualname__, str(exc), trace))

    def reply_remote_error(self, call_id: int, error: tuple[str, str, str]) -> None:
        body = wire.encode_body({"error": list(error)}, self.agent.who)
        self._send(wire.REPLY, call_id, body)

    def _send(self, kind: int, call_id: int, body) -> None:
        with self.lock:
            if self.closed:
                return
            try:
                wire.send_frame(self.sock, kind, call_id, *body)
            except OSError:
                pass  # the caller is gone; its own side reports that

    def close(self, bye: bool = False) -> None:
        with self.lock:
            if self.closed:
                return
            if bye:
                try:
                    self.sock.settimeout(1.0)
                    wire.send_frame(self.sock, wire.BYE, 0)
                except OSError:
                    pass
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.agent.forget_connection(self)


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
        self._call_ids = itertools.count(1)
        self._rref_ids = itertools.count(1)
        self._state = "running"
        self._lock = threading.Lock()
        self._channels: dict[int, _Channel] = {}
        self._connecting: dict[int, threading.Lock] = {}
        self._gone: dict[int, str] = {}
        self._connections: set[_ServerConnection] = set()
        self._deadlines: list[tuple] = []  # (deadline, call id, seconds, future, channel, ...)
        self._deadline_cond = threading.Condition()
        self._releases: queue.SimpleQueue = queue.SimpleQueue()
        self.inline: dict[tuple[_ServerConnection, int], float] = {}  # run -> since
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
            "max_message": self.max_message,
        }
        self.store.set(f"rpc/worker/{self.rank}", json.dumps(me))
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
            self._limits[rank] = int(entry["max_message"])

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
            + ("" if reason.startswith(_LEFT) else "; its calls cannot complete"),
            peer=peer.id,
        )

    def peer_gone(self, rank: int, reason: str | None) -> None:
        with self._lock:
            if reason is not None and rank not in self._gone and rank != self.rank:
                self._gone[rank] = reason

    def _channel(self, peer: WorkerInfo, timeout: float) -> _Channel:
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
                sock = connect(host, port, self.secret, self.rank, timeout, f"worker {peer.name!r}")
            except PeerError as exc:
                self.peer_gone(peer.id, "cannot be reached (it died or shut down)")
                raise PeerError(
                    f"{self.who}: worker {peer.name!r} (rank {peer.id}) cannot be reached; it "
                    f"died or shut down ({exc})",
                    peer=peer.id,
                ) from None
            channel = _Channel(self, peer, sock)
            self._channels[peer.id] = channel
            if self._state == "closed":
                channel.close(_LEFT)
                self.check_running("a call")
            return channel

    # -- calls out ---------------------------------------------------------------------------

    def call(
        self, to: Any, request: dict, timeout: float | None, what: str, wait: bool
    ) -> Future | Any:
        """Send ``request`` to ``to``; its Future (``wait=False``) or its result."""
        self.check_running(what)
        peer = self.worker(to)
        seconds = self.timeout_of(timeout)
        request["timeout"] = seconds
        body = self.encode(request, peer.id, request=True, who=f"{self.who}: {what}")
        limit = self._limits.get(peer.id, wire.DEFAULT_MAX_MESSAGE)
        size = sum(p.nbytes for p in body[1])
        if size > limit:
            self._undo_counts(body)
            raise ValueError(
                f"{self.who}: {what} carries {size} bytes of arrays, more than worker "
                f"{peer.name!r} accepts ({limit}; its init_rpc max_message_bytes)"
            )
        future = Future()
        call_id = next(self._call_ids)
        try:
            channel = self._channel(peer, seconds)
            channel.send(wire.REQUEST, call_id, body, future)
        except BaseException:
            self._undo_counts(body)
            raise
        if wait:
            if not channel.wait(future, time.monotonic() + seconds):
                channel.pending.pop(call_id, None)
                channel.want_reader()  # the late reply must still be read off the connection
                raise self._timed_out(what, peer, seconds)
            return future.result(0)
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
            for (connection, token), since in list(self.inline.items()):
                if now - since > INLINE_LIMIT:
                    connection.hand_over(token)

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
        self._releases.put((owner, rid))

    def _release_loop(self) -> None:
        while True:
            item = self._releases.get()
            if item is None:
                return
            self.release(*item)

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
        connection = _ServerConnection(self, sock, peer)
        with self._lock:
            self._connections.add(connection)
        connection.start()

    def forget_connection(self, connection: _ServerConnection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def note(self, body: Any) -> None:
        if (
            isinstance(body, dict)
            and body.get("op") == "decref"
            and isinstance(body.get("rref"), str)
        ):
            self.table.decref(body["rref"])

    def serve(
        self, connection: _ServerConnection, call_id: int, request: Any, token: int | None = None
    ) -> None:
        """One request, read on ``connection``'s thread: bookkeeping at once, handlers on the
        pool."""
        try:
            if not isinstance(request, dict):
                raise ValueError("a request that is not a dict")
            op = request.get("op")
            timeout = request.get("timeout")
            if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
                raise ValueError("a request without a timeout")
            expires = time.monotonic() + float(timeout)
            if op == "incref":
                self.table.incref(_text(request, "rref"))
                connection.reply(call_id, None)
            elif op == "call":
                target = registry.resolve(_text(request, "fn"))
                args, kwargs = _arguments(request)
                self._submit(connection, call_id, expires, lambda: target(*args, **kwargs), token)
            elif op == "remote":
                target = registry.resolve(_text(request, "fn"))
                args, kwargs = _arguments(request)
                rid = _text(request, "rref")
                if connection.peer != self.rank:
                    self.table.create(rid)
                self._submit_into(
                    connection, call_id, expires, rid, lambda: target(*args, **kwargs)
                )
            elif op == "method":
                rid, method = _text(request, "rref"), _text(request, "method")
                args, kwargs = _arguments(request)
                into = request.get("into")
                if into is not None and connection.peer != self.rank:
                    self.table.create(_text(request, "into"))

                def when_ready(entry):
                    def run():
                        if entry.error is not None:
                            raise _Reraised(entry.error)
                        return registry.method_of(entry.value, method)(*args, **kwargs)

                    if into is None:
                        self._submit(connection, call_id, expires, run)
                    else:
                        self._submit_into(connection, call_id, expires, into, run)

                self.table.when_ready(rid, when_ready)
            elif op == "fetch":
                rid = _text(request, "rref")

                def send_value(entry):
                    def run():
                        if entry.error is not None:
                            raise _Reraised(entry.error)
                        return entry.value

                    self._submit(connection, call_id, expires, run)

                self.table.when_ready(rid, send_value)
            else:
                raise ValueError(f"unknown request {str(op)[:40]!r}")
        except Exception as exc:
            connection.reply_error(call_id, exc)

    def _submit(self, connection, call_id: int, expires: float, run, token=None) -> None:
        """Run a handler: on the reading thread ``token`` when given and the pool has room,
        else on the pool."""

        def job() -> None:
            if time.monotonic() > expires:
                connection.reply_error(call_id, TimeoutError("the call expired in the queue"))
                return
            try:
                result = run()
            except _Reraised as exc:
                connection.reply_remote_error(call_id, exc.error)
                return
            except BaseException as exc:
                connection.reply_error(call_id, exc)
                return
            connection.reply(call_id, result)

        if token is None or not connection.run_inline(job, token):
            self.pool.submit(job)

    def _submit_into(self, connection, call_id: int, expires: float, rid: str, run) -> None:
        def make():
            try:
                value = run()
            except _Reraised as exc:
                self.table.fulfil(rid, exc=PluribusError(exc.error[1]))
                raise
            except BaseException as exc:
                self.table.fulfil(rid, exc=exc)
                raise
            self.table.fulfil(rid, value)

        self._submit(connection, call_id, expires, make)

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
        futures = [f for channel in list(self._channels.values()) for f in channel.pending.values()]
        concurrent.futures.wait(futures, timeout=max(0.0, deadline - time.monotonic()))

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
            channel.close(_LEFT)
        with self._deadline_cond:
            self._deadline_cond.notify_all()
        self._releases.put(None)
        self.pool.close()
        self.table.clear()


class _Body(tuple):
    """(description, pieces) of an encoded value, with the counts added for its RRefs."""

    counted: list[tuple[int, str]]

    def __new__(cls, description: bytes, pieces: list, counted: list):
        body = super().__new__(cls, (description, pieces))
        body.counted = counted
        return body


class _Reraised(Exception):
    """An error kept from making an RRef's value, to be sent on as it was."""

    def __init__(self, error: tuple[str, str, str]):
        super().__init__(error[1])
        self.error = error


def _text(request: dict, key: str) -> str:
    value = request.get(key)
    if not isinstance(value, str) or not value or len(value) > 512:
        raise ValueError(f"a request whose {key!r} is not a name")
    return value


def _arguments(request: dict) -> tuple[tuple, dict]:
    args = request.get("args", ())
    kwargs = request.get("kwargs", {})
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
        raise ValueError("a request whose arguments are not a tuple and a dict")
    if not all(isinstance(k, str) for k in kwargs):
        raise ValueError("keyword argument names must be strings")
    return tuple(args), kwargs
