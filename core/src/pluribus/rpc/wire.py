"""The RPC's frames: the bytes an authenticated connection carries, and the checks on reading.

A frame is a fixed header (magic, kind, call id, description length, heap length), the JSON
description of its value (:mod:`pluribus.codec`) and the heap of raw pieces (array bytes) it
points into. Arrays are written straight from their memory with ``sendmsg`` and read into one
buffer that the decoded arrays then view, so a large array is never copied into an encoding.
Between workers of one host a large heap travels in a shared-memory segment instead
(:mod:`pluribus.rpc.segments`): the frame then carries the segment's descriptor number after
its description, and its heap length is the segment's size.
Every length is checked against its limit before a byte of the body is read.

A small call whose arguments are all plain JSON values (None, bool, int, float, str and lists
of them) travels as a ``CALL`` frame instead: its description is the JSON
``[name, args, kwargs, timeout]``, with no heap and nothing for the codec to walk on either
side, and a plain result comes back the same way, as a ``RESULT`` frame holding the value's
JSON. Both decode to the values the codec would have given (JSON is the codec's encoding of
these types). Everything else, and every error, uses ``REQUEST`` and ``REPLY`` frames.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

import numpy as np

from .. import codec

MAGIC = b"PRPC"
HEADER = struct.Struct("<4sBB2xQQQ")  # magic, kind, flags, call id, description, heap length
#: The flag of a frame whose heap is in a segment, located by the ``LOCATOR`` after the
#: description.
IN_SEGMENT = 1
LOCATOR = struct.Struct("<QQQ")  # the segment's file descriptor (sender's), id and serial

#: Frame kinds. A request is answered by a reply with the same call id; a note is not answered.
#: A call (a small request in plain JSON) is answered by a result (a plain value) or a reply.
REQUEST, REPLY, NOTE, BYE, CALL, RESULT = 1, 2, 3, 4, 5, 6
KINDS = frozenset((REQUEST, REPLY, NOTE, BYE, CALL, RESULT))
_PLAIN_KINDS = (CALL, RESULT)

#: The largest JSON description accepted (the structure, not the arrays).
MAX_DESCRIPTION = 64 * 2**20
#: The default limit of a frame's heap (the raw bytes of its arrays); ``init_rpc`` can raise it.
DEFAULT_MAX_MESSAGE = 2**31
#: How much of a large body is read per ``recv`` call, and the buffer for small frames.
_CHUNK = 4 * 2**20
_BUFFER = 256 * 2**10


class FrameError(ValueError):
    """Bytes that are not a well-formed frame: the connection that sent them is closed."""


def parse_header(header: bytes, max_message: int) -> tuple[int, int, int, int, int]:
    """(kind, flags, call id, description length, heap length) of a frame header, checked."""
    if len(header) != HEADER.size:
        raise FrameError(f"a header of {len(header)} bytes, not {HEADER.size}")
    magic, kind, flags, call_id, description, heap = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if flags & ~IN_SEGMENT or (flags and kind not in (REQUEST, REPLY)):
        raise FrameError(f"flags {flags} on a frame of kind {kind}")
    if heap and kind in _PLAIN_KINDS:
        raise FrameError(f"a frame of kind {kind} with {heap} bytes of arrays (it has none)")
    if description > MAX_DESCRIPTION:
        raise FrameError(f"a description of {description} bytes (the limit is {MAX_DESCRIPTION})")
    if heap > max_message:
        raise FrameError(
            f"a message of {heap} bytes (the limit is {max_message}; raise init_rpc's "
            "max_message_bytes on the receiver)"
        )
    return kind, flags, call_id, description, heap


def decode_body(description: bytes, heap: Any, extension=None) -> Any:
    """The value of a frame; a FrameError for anything malformed (no input runs code)."""
    try:
        return codec.decode_parts(description, heap, extension, copy=False)
    except FrameError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:
        raise FrameError(f"a malformed message ({type(exc).__name__}: {str(exc)[:200]})") from None


def encode_body(
    value: Any, who: str, extension=None, root: str = "the message"
) -> tuple[bytes, list[memoryview]]:
    """The description and raw pieces of ``value``; a TypeError (from ``who``) for anything that
    cannot travel."""
    return codec.encode_parts(
        value,
        who,
        hint="cannot travel by RPC (arguments and results are numpy/cupy arrays, RRefs, None, "
        "bool, int, float, str, bytes, list, tuple and dict; never code); convert it, or keep "
        "it on its worker and pass an RRef",
        extension=extension,
        root=root,
    )


_PLAIN = frozenset((type(None), bool, int, float, str))


def _json_encoder():
    """``json.dumps`` (ASCII, NaN and infinities allowed) without its cost per call: for values
    this small, setting up an encoder costs twice the encoding. The same C encoder, made once."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return lambda value: json.dumps(value).encode()
    encoder = make(
        None, None, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )
    return lambda value: "".join(encoder(value, 0)).encode()


_encode_json = _json_encoder()
#: ``json.loads``'s C scanner, without its sniffing of the input's encoding and whitespace.
_scan_json = json.decoder.JSONDecoder().scan_once


def _decode_json(data: bytes, what: str) -> Any:
    """The JSON value that is all of ``data``; a FrameError for anything else."""
    try:
        text = data.decode()
        value, end = _scan_json(text, 0)
    except (ValueError, StopIteration, RecursionError) as exc:
        raise FrameError(f"a malformed {what} ({type(exc).__name__}: {str(exc)[:200]})") from None
    if end != len(text):
        raise FrameError(f"a malformed {what} (bytes after its JSON value)")
    return value


def _plain(value: Any) -> bool:
    """Whether JSON alone carries ``value`` exactly (exact types: a float subclass such as a
    numpy scalar, or a tuple, needs the codec to come back as what it was)."""
    kind = type(value)
    return kind in _PLAIN or (kind is list and all(map(_plain, value)))


def encode_call(name: str, args: tuple, kwargs: dict, timeout: float) -> bytes | None:
    """The description of a ``CALL`` frame; None when an argument is not plain (the call then
    goes as a ``REQUEST``)."""
    try:
        if not (all(map(_plain, args)) and all(map(_plain, kwargs.values()))):
            return None
    except RecursionError:
        return None
    return _encode_json([name, args, kwargs, timeout])


def decode_call(description: bytes) -> tuple[str, tuple, dict, float]:
    """(name, args, kwargs, timeout) of a ``CALL`` frame; a FrameError if malformed."""
    call = _decode_json(description, "call")
    if type(call) is not list or len(call) != 4:
        raise FrameError("a malformed call (not [name, args, kwargs, timeout])")
    name, args, kwargs, timeout = call
    if type(name) is not str or not name or len(name) > 512:
        raise FrameError("a call whose function is not a name")
    if type(args) is not list or type(kwargs) is not dict:
        raise FrameError("a call whose arguments are not a list and an object")
    if type(timeout) not in (int, float):
        raise FrameError("a call without a timeout")
    return name, tuple(args), kwargs, timeout


def encode_result(value: Any) -> bytes | None:
    """The description of a ``RESULT`` frame; None when ``value`` is not plain."""
    try:
        return _encode_json(value) if _plain(value) else None
    except RecursionError:
        return None


def decode_result(description: bytes) -> Any:
    """The value of a ``RESULT`` frame; a FrameError if it is not JSON."""
    return _decode_json(description, "result")


def send_frame(
    sock: socket.socket,
    kind: int,
    call_id: int,
    description: bytes = b"",
    pieces: list[memoryview] | tuple = (),
    segment: tuple[int, int, int] | None = None,
) -> None:
    """Write one frame; the caller holds the connection's send lock. With ``segment`` (the
    file descriptor, id and serial of a segment holding the pieces), only its locator follows the
    description."""
    if not pieces and segment is None:  # a small frame: one write, no bookkeeping
        sock.sendall(HEADER.pack(MAGIC, kind, 0, call_id, len(description), 0) + description)
        return
    heap = sum(p.nbytes for p in pieces)
    flags = 0 if segment is None else IN_SEGMENT
    header = HEADER.pack(MAGIC, kind, flags, call_id, len(description), heap)
    buffers = [memoryview(header)]
    if description:
        buffers.append(memoryview(description))
    if segment is None:
        buffers.extend(p for p in pieces if p.nbytes)
    else:
        buffers.append(memoryview(LOCATOR.pack(*segment)))
        heap = 0
    if heap < 65536:  # one small write beats sendmsg's bookkeeping
        sock.sendall(b"".join(buffers))
        return
    while buffers:
        sent = sock.sendmsg(buffers[:512])
        while buffers and sent >= buffers[0].nbytes:
            sent -= buffers[0].nbytes
            buffers.pop(0)
        if sent:
            buffers[0] = buffers[0][sent:]


class FrameReader:
    """Reads frames from one socket with as few system calls as possible: small frames come
    out of one buffered ``recv``, large heaps are read straight into their own array.

    ``open_segment(fd, segment id, serial, size)`` maps a segment the peer announces; without it a
    segment frame is malformed."""

    def __init__(self, sock: socket.socket, max_message: int, open_segment=None):
        self.sock = sock
        self.max_message = max_message
        self.open_segment = open_segment
        self._buffer = bytearray(_BUFFER)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0

    def buffered(self) -> int:
        """Bytes read from the socket and not yet returned in a frame."""
        return self._end - self._start

    def _fill(self, need: int) -> bool:
        """At least ``need`` buffered bytes; False at the end of the stream."""
        if self._end - self._start >= need:
            return True
        if self._start:
            left = self._end - self._start
            self._buffer[:left] = self._buffer[self._start : self._end]
            self._start, self._end = 0, left
        while self._end < need:
            n = self.sock.recv_into(self._view[self._end :])
            if n == 0:
                return False
            self._end += n
        return True

    def _take(self, size: int) -> bytes:
        data = bytes(self._view[self._start : self._start + size])
        self._start += size
        return data

    def read(self) -> tuple[int, int, bytes, Any] | None:
        """(kind, call id, description, heap) of the next frame; None at a clean end of the
        stream (between frames). ConnectionError when it ends inside a frame."""
        if not self._fill(HEADER.size):
            if self._end - self._start:
                raise ConnectionError("the connection closed inside a message")
            return None
        kind, flags, call_id, description_size, heap_size = parse_header(
            self._take(HEADER.size), self.max_message
        )
        description = b""
        if description_size:
            if description_size <= _BUFFER:
                if not self._fill(description_size):
                    raise ConnectionError("the connection closed inside a message")
                description = self._take(description_size)
            else:
                description = bytes(self._read_into(np.empty(description_size, np.uint8)))
        if not flags & IN_SEGMENT:
            if not heap_size:
                return kind, call_id, description, b""
            return kind, call_id, description, self._read_into(np.empty(heap_size, np.uint8))
        if not self._fill(LOCATOR.size):
            raise ConnectionError("the connection closed inside a message")
        fd, segment_id, serial = LOCATOR.unpack(self._take(LOCATOR.size))
        if self.open_segment is None or heap_size == 0 or fd > 2**31:
            raise FrameError("a shared-memory segment from a peer that may not send one")
        try:
            heap = self.open_segment(fd, segment_id, serial, heap_size)
        except ValueError as exc:
            raise FrameError(str(exc)) from None
        return kind, call_id, description, heap

    def _read_into(self, target: np.ndarray) -> np.ndarray:
        size = target.nbytes
        view = memoryview(target)
        got = min(size, self._end - self._start)
        view[:got] = self._view[self._start : self._start + got]
        self._start += got
        while got < size:
            n = self.sock.recv_into(view[got : got + _CHUNK])
            if n == 0:
                raise ConnectionError("the connection closed inside a message")
            got += n
        return target


def recv_frame(sock: socket.socket, max_message: int) -> tuple[int, int, bytes, Any] | None:
    """One frame from ``sock`` without buffering past it (for tests and one-off readers)."""
    header = _recv_exact(sock, HEADER.size, at_start=True)
    if header is None:
        return None
    kind, flags, call_id, description_size, heap_size = parse_header(header, max_message)
    if flags:
        raise FrameError("a shared-memory segment where none is expected")
    description = _recv_exact(sock, description_size) if description_size else b""
    heap = np.frombuffer(_recv_exact(sock, heap_size), dtype=np.uint8) if heap_size else b""
    return kind, call_id, description, heap


def _recv_exact(sock: socket.socket, size: int, at_start: bool = False) -> bytes | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            if at_start and got == 0:
                return None
            raise ConnectionError("the connection closed inside a message")
        got += n
    return bytes(buf)
