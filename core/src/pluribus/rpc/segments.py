"""Large array payloads between workers of one host, through sealed anonymous memory.

TCP on one host moves about half the bytes per second that shared memory does. So a frame
whose arrays reach ``SEGMENT_MIN`` bytes, sent to a worker that proved at start-up that it can
read this process's memory files, carries its heap in a *segment* instead: a ``memfd`` (memory
with no name in any file system) that the sender fills with one ``pwritev`` and seals
against writing, growing and shrinking. Only the segment's file descriptor number travels on
the connection. The receiver opens it through ``/proc/<sender pid>/fd/<n>`` (the sender's pid
is the one the worker published in the job's authenticated store, and the link must name a
pluribus segment), checks its size and seals, and maps it copy-on-write: the decoded arrays
view the mapping, writable, and stay valid after the sender lets go, because sealed memory can
be neither changed nor cut short under them.

Nothing is ever left behind: a memfd lives only while a process holds it open or mapped, so a
crash on either side frees it. The sender keeps each segment open until the receiver says it
has mapped it (the reply to a request, or a note for a reply) or the connection ends.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets

import numpy as np

#: Frames whose arrays reach this many bytes travel through a segment (below it, TCP's copy
#: costs less than making and mapping a segment).
SEGMENT_MIN = 256 * 2**10

_SEGMENT_NAME = "pluribus-rpc-segment"
_PROBE_NAME = "pluribus-rpc-probe"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_IOV_MAX = 512


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


def write(pieces: list[memoryview], size: int) -> int:
    """A sealed segment holding ``pieces`` one after the other; its file descriptor, which
    the caller closes once the receiver has mapped it."""
    fd = _new_memfd(_SEGMENT_NAME)
    try:
        views = [p for p in pieces if p.nbytes]
        offset = 0
        while views:
            written = os.pwritev(fd, views[:_IOV_MAX], offset)
            if written <= 0:
                raise OSError("a segment write made no progress")
            offset += written
            while views and written >= views[0].nbytes:
                written -= views[0].nbytes
                views.pop(0)
            if written:
                views[0] = views[0][written:]
        if offset != size:
            raise OSError(f"wrote {offset} bytes of a {size}-byte segment")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SegmentError(ValueError):
    """A segment descriptor that does not lead to a sealed pluribus segment of its size."""


def open_mapped(pid: int, fd: int, size: int) -> np.ndarray:
    """The ``size`` bytes of segment ``fd`` of process ``pid``, mapped copy-on-write."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:{_SEGMENT_NAME}"):
            raise SegmentError(f"{path} is not an RPC segment")
        segment = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SegmentError(f"cannot open the segment {path}: {exc}") from None
    try:
        if os.fstat(segment).st_size != size:
            raise SegmentError(f"the segment {path} does not hold the {size} bytes announced")
        if fcntl.fcntl(segment, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise SegmentError(f"the segment {path} is not sealed; it could change under use")
        mapping = mmap.mmap(
            segment, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
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
