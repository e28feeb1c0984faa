"""The serving side of a connection from a peer: requests and notes in, replies out.

One thread reads each connection. It answers reference bookkeeping at once and runs a small
handler itself; when a handler waits for another call or runs longer than ``INLINE_LIMIT``,
another thread takes over reading, so the peer's other calls are not held up. Other handlers
run on the agent's bounded pool.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from ..errors import PluribusError
from . import registry, wire
from .errors import DIED

if TYPE_CHECKING:
    from .agent import Agent

#: A handler run on a connection's reading thread longer than this (seconds) hands reading on.
INLINE_LIMIT = 0.02


class ServerConnection:
    """One peer's connection to this worker's server: requests and notes in, replies out."""

    def __init__(self, agent: Agent, sock: socket.socket, peer: int):
        self.agent = agent
        self.sock = sock
        self.peer = peer
        self.lock = threading.Lock()
        self.closed = False
        self.name = agent.workers[peer].name if peer < len(agent.workers) else str(peer)
        self._reader = wire.FrameReader(
            sock,
            agent.max_message,
            lambda *locator: agent.open_segment(peer, *locator),
        )
        self._role = threading.Lock()
        self._readers = itertools.count()
        self._reading = next(self._readers)  # which thread reads now
        #: (reading thread, start time) of the handler running on the reading thread, if any
        self.inline_run: tuple[int, float] | None = None

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
        waits for a call or outlives ``INLINE_LIMIT`` (``hand_over``). False when the pool is
        full."""
        run = (token, time.monotonic())
        self.inline_run = run
        try:
            return self.agent.pool.run_here(job, lambda: self.hand_over(run))
        finally:
            with self._role:
                if self.inline_run is run:
                    self.inline_run = None

    def hand_over(self, run: tuple[int, float]) -> None:
        """Let a new thread read instead of the one running the handler ``run``, if that
        handler still runs there."""
        with self._role:
            if self.inline_run is not run or self._reading != run[0]:
                return
            self.inline_run = None
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
                # the last request's arrays (maybe a segment lent by the peer) must not live on
                # while this thread waits for the next one
                frame = heap = body = None
                try:
                    frame = reader.read()
                except wire.FrameError as exc:
                    # the stream cannot be followed past a bad header: say why, then hang up
                    self.reply_error(0, exc)
                    break
                if frame is None:
                    break
                kind, call_id, description, heap = frame
                if kind == wire.CALL:
                    serve_call(self.agent, self, call_id, description, token)
                    if not self._still_reader(token):
                        return  # another thread reads on; this one ran a handler
                    continue
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
                    serve(self.agent, self, call_id, body, token)
                    if not self._still_reader(token):
                        return  # another thread reads on; this one ran a handler
                elif kind == wire.NOTE:
                    note(self.agent, self.peer, body)
        except OSError:
            pass
        self.close()
        if not said_bye:
            self.agent.peer_gone(self.peer, DIED)

    def reply(self, call_id: int, value: Any, plain: bool = False) -> None:
        """Send a handler's result; with ``plain`` (the call came as a ``CALL`` frame), a plain
        value goes back as a ``RESULT`` frame."""
        if plain:
            description = wire.encode_result(value)
            if description is not None:
                self._send(wire.RESULT, call_id, (description, ()))
                return
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
        description, pieces = body
        segment = None
        if pieces:
            segment = self.agent.lend_segment(pieces, sum(p.nbytes for p in pieces), self.peer)
        with self.lock:
            if self.closed:
                if segment is not None:
                    self.agent.segment_pool.give_back(segment[2], self.peer)
                return
            try:
                wire.send_frame(self.sock, kind, call_id, description, pieces, segment)
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


def note(agent: Agent, peer: int, body: Any) -> None:
    """A note from a peer: a released reference, or a segment it no longer views."""
    if not isinstance(body, dict):
        return
    if body.get("op") == "decref" and isinstance(body.get("rref"), str):
        agent.table.decref(body["rref"])
    elif body.get("op") == "segment-free" and type(body.get("serial")) is int:
        agent.segment_pool.give_back(body["serial"], peer)


def serve_call(
    agent: Agent, connection: ServerConnection, call_id: int, description: bytes, token: int
) -> None:
    """A small call (a ``CALL`` frame): an exposed function with plain arguments, run like
    ``serve``'s calls but with nothing for the codec to do."""
    try:
        name, args, kwargs, timeout = wire.decode_call(description)
        target = registry.resolve(name)
    except Exception as exc:
        connection.reply_error(call_id, exc)
        return
    expires = time.monotonic() + timeout
    _submit(agent, connection, call_id, expires, lambda: target(*args, **kwargs), token, True)


def serve(
    agent: Agent, connection: ServerConnection, call_id: int, request: Any, token: int | None = None
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
            agent.table.incref(_text(request, "rref"))
            connection.reply(call_id, None)
        elif op == "call":
            target = registry.resolve(_text(request, "fn"))
            args, kwargs = _arguments(request)
            _submit(agent, connection, call_id, expires, lambda: target(*args, **kwargs), token)
        elif op == "remote":
            target = registry.resolve(_text(request, "fn"))
            args, kwargs = _arguments(request)
            rid = _text(request, "rref")
            if connection.peer != agent.rank:
                agent.table.create(rid)
            _submit_into(agent, connection, call_id, expires, rid, lambda: target(*args, **kwargs))
        elif op == "method":
            rid, method = _text(request, "rref"), _text(request, "method")
            args, kwargs = _arguments(request)
            into = request.get("into")
            if into is not None and connection.peer != agent.rank:
                agent.table.create(_text(request, "into"))

            def when_ready(entry):
                def run():
                    if entry.error is not None:
                        raise _Reraised(entry.error)
                    return registry.method_of(entry.value, method)(*args, **kwargs)

                if into is None:
                    _submit(agent, connection, call_id, expires, run)
                else:
                    _submit_into(agent, connection, call_id, expires, into, run)

            agent.table.when_ready(rid, when_ready)
        elif op == "fetch":
            rid = _text(request, "rref")

            def send_value(entry):
                def run():
                    if entry.error is not None:
                        raise _Reraised(entry.error)
                    return entry.value

                _submit(agent, connection, call_id, expires, run)

            agent.table.when_ready(rid, send_value)
        else:
            raise ValueError(f"unknown request {str(op)[:40]!r}")
    except Exception as exc:
        connection.reply_error(call_id, exc)


def _submit(
    agent: Agent, connection, call_id: int, expires: float, run, token=None, plain=False
) -> None:
    """Run a handler: on the reading thread ``token`` when given and the pool has room,
    else on the pool. ``plain``: the call came as a ``CALL`` frame."""

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
        connection.reply(call_id, result, plain)

    if token is None or not connection.run_inline(job, token):
        agent.pool.submit(job)


def _submit_into(agent: Agent, connection, call_id: int, expires: float, rid: str, run) -> None:
    def make():
        try:
            value = run()
        except _Reraised as exc:
            agent.table.fulfil(rid, exc=PluribusError(exc.error[1]))
            raise
        except BaseException as exc:
            agent.table.fulfil(rid, exc=exc)
            raise
        agent.table.fulfil(rid, value)

    _submit(agent, connection, call_id, expires, make)


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
