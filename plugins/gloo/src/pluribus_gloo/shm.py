"""Shared-memory rings between two ranks on one host.

One segment per pair of ranks holds two single-producer single-consumer byte rings, one per
direction. Each ring has a control block (``head`` written only by the producer, ``tail`` only
by the consumer, and two "I am asleep" flags, each on its own cache line) and a data area whose
size is a multiple of 64. A side that stops polling sets its flag and sleeps on the pair's
socket; the other side, after moving ``head`` or ``tail``, sees the flag and rings the socket.
Messages are a 64-byte header followed by the payload, padded to 64 bytes, so a header never
wraps and a payload always starts aligned: a receiver can reduce straight out of the ring.

The protocol needs only that aligned 8-byte stores are atomic and that stores become visible in
program order (x86-64's memory model); on other CPUs the fast path is off unless asked for.

A segment exists in /dev/shm only while the pair is connecting: its creator unlinks it as soon as
the peer says it has mapped it (or failed to), so no segment outlives the processes, even when
one is killed. Only a job whose every member is killed inside such a window (the arena's and the
symmetric allocations' too) leaves one behind; every segment's name starts with its creator's
pid, and :func:`sweep_orphans` removes those whose creator is gone.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import time

import numpy as np
from pluribus.lifeline import pid_alive

log = logging.getLogger("pluribus.gloo")

CONTROL_BYTES = 256
# 8-byte words of the control block, each on its own cache line
HEAD, TAIL, READER_WAITING, WRITER_WAITING = 0, 8, 16, 24
ALIGN = 64
#: Every segment's name: ``/plrb-<creator's pid>-...`` (the symmetric allocations' names extend
#: their arena's, which the same process created).
PREFIX = "plrb-"
SHM_DIR = "/dev/shm"
#: A segment of a dead creator is removed only once it is this old: a live job's segment exists
#: by name only while its group maps it, and a pid from another pid namespace sharing /dev/shm
#: may look dead here.
ORPHAN_SECONDS = float(os.environ.get("PLURIBUS_GLOO_ORPHAN_SECONDS", 60))

try:
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None


def supported() -> bool:
    """Whether the shared-memory path is safe to use on this machine by default."""
    return _posixshmem is not None and platform.machine().lower() in ("x86_64", "amd64")


def segment_size(capacity: int) -> int:
    return 2 * (CONTROL_BYTES + capacity)


def create_mapping(nbytes: int, reserve: bool = False, name: str = "") -> tuple[str, mmap.mmap]:
    """Create and map a fresh segment of ``nbytes`` (named ``name``, else a new unique name);
    the caller unlinks it. ``reserve`` takes the pages now, so that a full /dev/shm is an
    OSError here rather than a SIGBUS when a page is first touched (worth it for large
    segments that user data lives in)."""
    name = name or f"/{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if reserve and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)
    return name, mm


def open_mapping(name: str, nbytes: int) -> mmap.mmap:
    fd = _posixshmem.shm_open(name, os.O_RDWR, 0o600)
    try:
        if os.fstat(fd).st_size != nbytes:
            raise OSError(f"shared-memory segment {name} has an unexpected size")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def map_if_possible(name: str, nbytes: int, what: str) -> mmap.mmap | None:
    """``open_mapping``, or None (logged) when this process cannot map the segment: its group
    then agrees on doing without it."""
    try:
        return open_mapping(name, nbytes)
    except OSError as exc:
        log.info("gloo: cannot map %s %s (%s)", what, name, exc)
        return None


def create_segment(capacity: int) -> tuple[str, mmap.mmap]:
    """Create and map a fresh segment for one pair; the caller unlinks it."""
    return create_mapping(segment_size(capacity))


def open_segment(name: str, capacity: int) -> mmap.mmap:
    return open_mapping(name, segment_size(capacity))


def sweep_orphans(older_than: float = ORPHAN_SECONDS) -> list[str]:
    """Unlink the segments in /dev/shm whose creating process is gone and that were last written
    ``older_than`` seconds ago or more; returns their names. Called by each group's first rank
    before it creates the group's arena, so that a killed job's leftovers go with the next job
    on the host."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not entry.startswith(PREFIX):
            continue
        creator = entry[len(PREFIX) :].split("-", 1)[0]
        if not creator.isdigit() or pid_alive(int(creator)):
            continue
        try:
            if time.time() - os.stat(os.path.join(SHM_DIR, entry)).st_mtime < older_than:
                continue
            _posixshmem.shm_unlink("/" + entry)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
        removed.append(entry)
    if removed:
        log.info("gloo: removed %d segment(s) left by killed jobs: %s", len(removed), removed)
    return removed


def unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        pass


class Ring:
    """One direction of a pair's segment. The same object serves the producer or the consumer."""

    def __init__(self, mm: mmap.mmap, index: int, capacity: int):
        offset = index * (CONTROL_BYTES + capacity)
        self.capacity = capacity
        self.control = memoryview(mm)[offset : offset + CONTROL_BYTES].cast("Q")
        self.data = np.frombuffer(mm, dtype=np.uint8, count=capacity, offset=offset + CONTROL_BYTES)
        self.raw = memoryview(mm)[offset + CONTROL_BYTES : offset + CONTROL_BYTES + capacity]
        # local copies of the counters this side owns
        self.head = self.control[0]
        self.tail = self.control[8]

    # -- producer
    def space(self) -> int:
        return self.capacity - (self.head - self.control[8])

    def write_small(self, data: bytes) -> None:
        """Write a header, or a whole small message, at the aligned head and publish it."""
        pos = self.head % self.capacity
        first = min(len(data), self.capacity - pos)
        self.raw[pos : pos + first] = data[:first]
        if first < len(data):
            self.raw[: len(data) - first] = data[first:]
        self.head += len(data)
        self.control[0] = self.head

    def write(self, src: np.ndarray) -> None:
        """Copy ``src`` (uint8, at most ``space()`` bytes) in, wrapping if needed, and publish."""
        n = src.size
        pos = self.head % self.capacity
        first = min(n, self.capacity - pos)
        np.copyto(self.data[pos : pos + first], src[:first])
        if first < n:
            np.copyto(self.data[: n - first], src[first:])
        self.head += n
        self.control[0] = self.head

    def advance(self, n: int) -> None:
        """Skip ``n`` bytes of padding (the caller checked the space)."""
        self.head += n
        self.control[0] = self.head

    # -- consumer
    def available(self) -> int:
        return self.control[0] - self.tail

    def peek(self, n: int) -> np.ndarray:
        """Up to ``n`` readable bytes that are contiguous in the ring (fewer at the wrap)."""
        pos = self.tail % self.capacity
        return self.data[pos : pos + min(n, self.capacity - pos)]

    def read_small(self, n: int) -> bytes:
        pos = self.tail % self.capacity
        return bytes(self.raw[pos : pos + n])

    def consume(self, n: int) -> None:
        self.tail += n
        self.control[8] = self.tail

    def release(self) -> None:
        self.control.release()
        self.raw.release()
        self.data = None
