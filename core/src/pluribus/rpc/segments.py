"""Large array payloads between workers of one host, through anonymous shared memory.

TCP on one host moves about half the bytes per second that shared memory does. So a frame
whose arrays reach ``SEGMENT_MIN`` bytes, sent to a worker that proved at start-up that it can
open this process's memory files, carries its heap in a *segment* instead: a ``memfd`` (memory
with no name in any file system), sealed at its size, that the sender fills through its
own mapping. Only the segment's file descriptor number, id and serial travel on the
connection.
The receiver opens it through ``/proc/<sender pid>/fd/<n>`` (the pid the sender published in
the job's authenticated store; the link must name a pluribus segment), checks its size and
seals, and maps it (once: ``MappedSegments`` keeps the mapping for the segment's next
visits): the decoded arrays view the mapping, writable, and can never fault on memory cut
short under them. The segment is the receiver's until every array viewing it is
gone; then it tells the sender, which may write it again (``SegmentPool``).

Nothing is ever left behind: a memfd lives only while a process holds it open or mapped, so a
crash or shutdown on either side frees it, and no name appears in /dev/shm.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import mmap
import os
import secrets
import threading
import time

import numpy as np

#: Frames whose arrays reach this many bytes travel through a segment (below it, TCP's copy
#: costs less than making and mapping a segment).
SEGMENT_MIN = 256 * 2**10

_SEGMENT_NAME = "pluribus-rpc-segment"
_PROBE_NAME = "pluribus-rpc-probe"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
#: A segment's size is fixed (it cannot be cut short under a reader's mapping); its content is
#: rewritten when it is reused.
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_GRANULE = 2**20


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _new_memfd(name: str) -> int:
    return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


class Probe:
    """A small sealed segment holding a random token, published at start-up so that each peer
    can find out whether it can read this process's segments (same kernel, same pid space,
    permission to open them)."""

    def __init__(self):
        self.fd: int | None = None
        self.token = secrets.token_bytes(16)
        if not hasattr(os, "memfd_create") or _boot_id() is None:
            return
        try:
            fd = _new_memfd(_PROBE_NAME)
            os.pwrite(fd, self.token, 0)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except OSError:
            return
        self.fd = fd

    def describe(self) -> dict | None:
        """What peers need to probe this process (None: it cannot offer segments)."""
        if self.fd is None:
            return None
        return {"boot": _boot_id(), "pid": os.getpid(), "fd": self.fd, "token": self.token.hex()}

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def can_read(described: object) -> bool:
    """Whether this process can open the segments of the worker whose probe is ``described``."""
    if not isinstance(described, dict) or described.get("boot") != _boot_id():
        return False
    try:
        pid, fd, token = int(described["pid"]), int(described["fd"]), str(described["token"])
        path = f"/proc/{pid}/fd/{fd}"
        if not os.readlink(path).startswith(f"/memfd:{_PROBE_NAME}"):
            return False
        probe = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(probe, 16, 0).hex() == token
        finally:
            os.close(probe)
    except (OSError, KeyError, ValueError, TypeError):
        return False


class _Segment:
    """One memfd, sealed at its capacity, and this process's mapping of it (kept, so that
    writing it again costs no page faults)."""

    __slots__ = ("id", "fd", "capacity", "mapping")

    def __init__(self, segment_id: int, size: int):
        self.id = segment_id
        self.capacity = -(-size // _GRANULE) * _GRANULE
        self.fd = _new_memfd(_SEGMENT_NAME)
        try:
            os.ftruncate(self.fd, self.capacity)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
            self.mapping = mmap.mmap(self.fd, self.capacity, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, pieces: list[memoryview]) -> None:
        offset = 0
        with memoryview(self.mapping) as view:
            for piece in pieces:
                view[offset : offset + piece.nbytes] = piece.cast("B")
                offset += piece.nbytes

    def close(self) -> None:
        self.mapping.close()
        os.close(self.fd)


class SegmentPool:
    """The segments this worker lends to its peers, reused once given back.

    A fresh segment costs a page fault per page on first write, several times a plain copy on
    this kind of machine, so segments are kept: a segment is *lent* to one peer with a frame,
    and *given back* by that peer (a note) once every array viewing it is gone; only then is it
    written again. Segments lent to a peer that is gone are closed, never reused, and at most
    ``FREE_LIMIT`` bytes of free segments are kept.

    In a loop of calls the note for the last segment often arrives just after the next call
    wants one; making a new segment then costs about as long as ``size / FRESH_BYTES_PER_S``
    seconds, so a caller that has a fitting segment out with that peer waits for it that long
    (``MAX_WAIT`` at most) before making one. A reply does not wait: the note it would wait
    for may have to be read by the very thread sending the reply.
    """

    FREE_LIMIT = 256 * 2**20
    FRESH_BYTES_PER_S = 2**30
    MAX_WAIT = 0.02

    def __init__(self):
        self._lock = threading.Condition()
        self._ids = itertools.count(1)
        self._serials = itertools.count(1)
        self._free: list[_Segment] = []  # oldest first
        self._lent: dict[int, tuple[_Segment, int]] = {}  # serial -> (segment, peer)

    def lend(
        self, pieces: list[memoryview], size: int, peer: int, wait: bool = False
    ) -> tuple[int, int, int]:
        """(fd, segment id, serial) of a segment holding ``pieces`` one after the other, lent
        to ``peer``; with ``wait``, waiting a little for one of its own to come back."""
        with self._lock:
            patience = min(size / self.FRESH_BYTES_PER_S, self.MAX_WAIT) if wait else 0.0
            deadline = time.monotonic() + patience
            while True:
                fits = [s for s in self._free if self._fits(s, size)]
                if fits or time.monotonic() >= deadline:
                    break
                if not any(self._fits(s, size) and p == peer for s, p in self._lent.values()):
                    break
                self._lock.wait(deadline - time.monotonic())
            segment = min(fits, key=lambda s: s.capacity) if fits else None
            if segment is not None:
                self._free.remove(segment)
            serial = next(self._serials)
            segment_id = next(self._ids)
        if segment is None:
            segment = _Segment(segment_id, size)
        try:
            segment.write(pieces)
        except BaseException:
            segment.close()
            raise
        with self._lock:
            self._lent[serial] = (segment, peer)
        return segment.fd, segment.id, serial

    @staticmethod
    def _fits(segment: _Segment, size: int) -> bool:
        return size <= segment.capacity <= 2 * size + _GRANULE

    def give_back(self, serial: int, peer: int) -> None:
        """``peer`` no longer views the segment ``serial`` (from any other peer: ignored)."""
        with self._lock:
            entry = self._lent.get(serial)
            if entry is None or entry[1] != peer:
                return
            del self._lent[serial]
            self._free.append(entry[0])
            self._lock.notify_all()
            closing = []
            while sum(s.capacity for s in self._free) > self.FREE_LIMIT:
                closing.append(self._free.pop(0))
        for segment in closing:
            segment.close()

    def forget_peer(self, peer: int) -> None:
        """Close (never reuse) what ``peer`` was lent: it is gone, or may still view them."""
        with self._lock:
            gone = [serial for serial, entry in self._lent.items() if entry[1] == peer]
            closing = [self._lent.pop(serial)[0] for serial in gone]
        for segment in closing:
            segment.close()

    def held(self) -> tuple[int, int]:
        """(segments lent, segments free): how many this worker holds open."""
        with self._lock:
            return len(self._lent), len(self._free)

    def close(self) -> None:
        """Close every segment; peers' mappings stay valid (a mapping keeps its memory)."""
        with self._lock:
            closing = self._free + [entry[0] for entry in self._lent.values()]
            self._free, self._lent = [], {}
        for segment in closing:
            segment.close()


class MappedSegments:
    """The peers' segments this worker has mapped, kept for when the same segment comes
    again (a new mapping costs a page fault per page touched). Each frame's heap is a fresh
    view of the kept mapping, so a frame's arrays are still tracked one frame at a time."""

    LIMIT = 512 * 2**20

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict[tuple[int, int], np.ndarray] = collections.OrderedDict()

    def heap(self, sender: int, pid: int, fd: int, segment_id: int, size: int) -> np.ndarray:
        key = (sender, segment_id)
        with self._lock:
            mapped = self._kept.get(key)
            if mapped is not None and mapped.nbytes >= size:
                self._kept.move_to_end(key)
                return mapped[:size]
        mapped = open_mapped(pid, fd, size)
        with self._lock:
            self._kept[key] = mapped
            while sum(m.nbytes for m in self._kept.values()) > self.LIMIT:
                self._kept.popitem(last=False)  # arrays still viewing it keep it mapped
        return mapped[:size]

    def forget(self, sender: int | None = None) -> None:
        """Drop the mappings of ``sender``'s segments (all without one)."""
        with self._lock:
            for key in [k for k in self._kept if sender is None or k[0] == sender]:
                del self._kept[key]


class SegmentError(ValueError):
    """A segment descriptor that does not lead to a sealed pluribus segment of its size."""


def open_mapped(pid: int, fd: int, size: int) -> np.ndarray:
    """The first ``size`` bytes of segment ``fd`` of process ``pid``, mapped (shared: the
    segment is this worker's until it gives it back)."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:{_SEGMENT_NAME}"):
            raise SegmentError(f"{path} is not an RPC segment")
        segment = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise SegmentError(f"cannot open the segment {path}: {exc}") from None
    try:
        if os.fstat(segment).st_size < size:
            raise SegmentError(f"the segment {path} is smaller than the {size} bytes announced")
        if fcntl.fcntl(segment, fcntl.F_GET_SEALS) & _SIZE_SEALS != _SIZE_SEALS:
            raise SegmentError(f"the segment {path} is not sealed; it could shrink under use")
        mapping = mmap.mmap(segment, size, flags=mmap.MAP_SHARED)
    except OSError as exc:
        raise SegmentError(f"cannot map the segment {path}: {exc}") from None
    finally:
        os.close(segment)
    return np.frombuffer(mapping, dtype=np.uint8)


def open_segment_count() -> int:
    """How many segments this process holds open (for tests: none once calls are answered)."""
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}").startswith(f"/memfd:{_SEGMENT_NAME}"):
                count += 1
        except OSError:
            pass
    return count
