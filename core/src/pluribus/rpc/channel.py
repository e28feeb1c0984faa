"""This worker's side of a connection to a peer it calls: requests and notes out, replies in."""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import TYPE_CHECKING

from ..errors import PluribusError
from . import wire
from .errors import DIED, LEFT
from .futures import Future, Reply
from .pool import current_pool, waiting

if TYPE_CHECKING:
    from .agent import Agent, WorkerInfo


class Channel:
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
        self.pending: dict[int, Future | Reply] = {}
        self.broken: str | None = None
        self._said_bye = False
        self._reader = wire.FrameReader(
            sock,
            agent.max_message,
            lambda *locator: agent.open_segment(peer.id, *locator),
        )
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

    def send(self, kind: int, call_id: int, body, future: Future | Reply | None = None) -> None:
        """Write a frame; with ``future``, a request whose reply will settle it (read by the
        caller in ``wait``, or by the channel's thread after ``want_reader``)."""
        description, pieces = body
        size = sum(p.nbytes for p in pieces) if pieces else 0
        segment = None
        if kind == wire.REQUEST and size:
            segment = self.agent.lend_segment(pieces, size, self.peer.id, wait=True)
        if segment is None and size > 65536 and self.owed():
            # someone must read replies while this thread may block sending: a peer blocked
            # sending a large reply is not reading this request
            self.want_reader()
        with self.lock:
            if self.broken is not None:
                if segment is not None:  # never sent: free to write again
                    self.agent.segment_pool.give_back(segment[2], self.peer.id)
                raise self.agent.gone_error(self.peer, self.broken)
            if future is not None:
                self.pending[call_id] = future
            try:
                wire.send_frame(self.sock, kind, call_id, description, pieces, segment)
                if kind == wire.REQUEST or kind == wire.CALL:
                    self._requests_sent += 1
            except OSError as exc:
                self.pending.pop(call_id, None)
                self.broken = DIED
                raise self.agent.gone_error(self.peer, f"{DIED}: {exc}") from None

    def owed(self) -> int:
        """Replies the peer still owes, including those of calls that timed out here."""
        return max(0, self._requests_sent - self._replies_read)

    def want_reader(self) -> None:
        with self._wanted:
            self._reader_wanted = True
            self._wanted.notify()

    def wait(self, reply: Reply, deadline: float) -> bool:
        """Read until ``reply`` is settled or ``deadline`` passes; False on the deadline."""
        if current_pool() is None:
            return self._wait(reply, deadline)
        with waiting():  # a handler waiting: its pool may run another meanwhile
            return self._wait(reply, deadline)

    def _wait(self, reply: Reply, deadline: float) -> bool:
        while not reply.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not self._role.acquire(blocking=False):
                reply.wait(min(left, 0.05))  # another thread reads, and will hand it on
                continue
            outcome = None
            try:
                if self.broken is None and (
                    self._reader.buffered() or self._poll.poll(left * 1000)
                ):
                    outcome = self._read_one()
            finally:
                self._role.release()
            if outcome is not None:
                self._settle(outcome)
            if self.broken is not None:  # close() is failing it
                reply.wait(min(left, 0.05))
        if self._requests_sent != self._replies_read:
            self.want_reader()  # replies others wait for, or that are owed still
        return True

    def _read_for_others(self) -> None:
        if self.agent.bind_thread is not None:  # futures' callbacks may call other workers
            self.agent.bind_thread(self.agent)
        while self.broken is None:
            with self._wanted:
                while not self._reader_wanted and self.broken is None:
                    self._wanted.wait()
                self._reader_wanted = False
            while self.owed() and self.broken is None:
                outcome = None
                with self._role:
                    if self.owed() and self.broken is None:
                        outcome = self._read_one()
                self._settle(outcome)

    def _read_one(self):
        """Read one frame, holding the reading role; what to do with it (``_settle``) is done
        after the role is released, so that a future's callbacks never run while holding it."""
        try:
            frame = self._reader.read()
            if frame is None:
                return ("close", LEFT if self._said_bye else DIED)
            kind, call_id, description, heap = frame
            if kind == wire.BYE:
                self._said_bye = True
                return None
            if kind != wire.REPLY and kind != wire.RESULT:
                raise wire.FrameError(f"a frame of kind {kind} where replies come")
            self._replies_read += 1
        except (OSError, ValueError) as exc:
            return ("close", LEFT if self._said_bye else f"{DIED}: {exc}")
        future = self.pending.pop(call_id, None)
        if future is None:  # timed out meanwhile
            return None
        try:
            if kind == wire.RESULT:
                return ("result", future, wire.decode_result(description))
            reply = self.agent.decode(description, heap, self.peer.id, request=False)
        except Exception as exc:
            error = PluribusError(f"{self.agent.who}: a bad reply from {self.peer.name!r}: {exc}")
            return ("failed", future, error)
        return ("reply", future, reply)

    def _settle(self, outcome) -> None:
        if outcome is None:
            return
        if outcome[0] == "close":
            self.close(outcome[1])
        elif outcome[0] == "failed":
            outcome[1].set_exception(outcome[2])
        elif outcome[0] == "result":
            outcome[1].set_result(outcome[2])
        else:
            self.agent.deliver(outcome[1], outcome[2], self.peer)

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
