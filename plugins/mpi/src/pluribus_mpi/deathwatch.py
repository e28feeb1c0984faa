"""Which rank died: one small watcher process per host names the first rank of the host that
ends without saying goodbye.

When a rank dies, mpiexec (MPICH's hydra) kills every other rank within milliseconds and names
one PID, often not the dead rank's; a thread in a surviving rank seldom runs before it is killed
too. The watcher is not a process mpiexec started, and it has a session of its own (mpiexec
kills each rank's session), so it outlives the ranks. The first rank of each host starts it
(``python -m pluribus_mpi.deathwatch``) with a listening Unix socket and the pid of every rank
of the host; every rank connects (the kernel gives the peer's pid: other processes are refused).
A rank that ends normally sends ``bye`` first; one that says itself why it ends (an uncaught
exception, MPI_Abort) sends ``end``, after which the watcher stays quiet about the ranks
mpiexec kills. A connection that closes without either is a rank that died.

Which died *first* is not the order in which connections close: a rank's sockets close only
after its memory is torn down, and by then MPICH may have made a survivor abort (a copy from the
dead rank's memory fails) and mpiexec killed the rest. So each rank's main thread also holds a
robust mutex in memory it shares with the watcher (a memfd passed over the socket), whose
threads wait on them: the kernel releases a dead thread's robust mutexes as the very first step
of tearing its memory down, before another rank can notice, and the watcher blames the rank
whose mutex came back first. It prints the rank,
pid, host and time (to compare hosts) on its standard error, which mpiexec shows before its own
summary, and exits when every rank of its host has gone. ``PLURIBUS_MPI_DEATHWATCH=0`` turns it
off.
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import secrets
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

ENV = "PLURIBUS_MPI_DEATHWATCH"
#: What a rank sends: first its mutex's memory, then before it ends normally, or after saying
#: itself why (an uncaught exception, MPI_Abort).
HELD = b"held;"
GOODBYE = b"bye;"
ANNOUNCED = b"end;"
#: How often the watcher checks that ranks it has not heard from yet still exist.
CHECK_SECONDS = 1.0
#: How long the watcher waits for the mutexes of ranks whose connections closed.
ORDER_SECONDS = 0.3
#: Bytes of a rank's mutex memory (a pthread_mutex_t is 40 or 48 bytes).
SLOT_BYTES = 128
EOWNERDEAD = 130

_lock = threading.Lock()
_connection: socket.socket | None = None
_mutex: Mutexes | None = None  # this rank's, held for the life of the process
_started = False


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1").strip().lower() not in (
        "0",
        "false",
        "no",
    )


# -- the ranks' side -------------------------------------------------------------------------------


def join(MPI: Any) -> None:
    """Every rank calls this once the world has started (a collective on COMM_WORLD): the first
    rank of each host starts the watcher, every rank connects to it. Once per process; any
    failure leaves this rank unwatched rather than failing the job."""
    global _started
    import numpy as np

    with _lock:
        if _started or not enabled() or MPI.COMM_WORLD.Get_size() == 1:
            return
        _started = True
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        ranks = np.zeros(2 * node.Get_size(), np.int64)
        node.Allgather(np.array([world.Get_rank(), os.getpid()], np.int64), ranks)
        name = bytearray(b"\0pluribus-mpi-" + secrets.token_hex(12).encode())
        node.Bcast(name, root=0)
        started = np.zeros(1, np.int8)
        if node.Get_rank() == 0:
            started[0] = _start_watcher(bytes(name), ranks.reshape(-1, 2).tolist())
        node.Bcast(started, root=0)
    finally:
        node.Free()
    if started[0]:
        connect(bytes(name))


def connect(name: bytes) -> bool:
    """Connect this rank to the watcher listening at ``name`` and hand it this rank's mutex."""
    global _mutex, _connection
    fd = -1
    try:
        fd = os.memfd_create("pluribus-mpi-deathwatch")
        os.ftruncate(fd, SLOT_BYTES)
        mutex = Mutexes(mmap.mmap(fd, SLOT_BYTES))
        mutex.init()
        # by the calling thread, the main one as a rule: the kernel releases the main thread's
        # robust mutexes before a copy from this process's memory can fail on another rank
        mutex.lock()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(name)
        socket.send_fds(connection, [HELD], [fd])
    except (OSError, AttributeError):
        return False
    finally:
        if fd >= 0:
            os.close(fd)
    _mutex, _connection = mutex, connection
    atexit.register(_at_exit)
    return True


def farewell(word: bytes = ANNOUNCED) -> None:
    """Tell the watcher that this rank ends on purpose: ``ANNOUNCED`` when it has said why
    (the watcher then stays quiet), ``GOODBYE`` for a normal end."""
    global _connection
    with _lock:
        connection, _connection = _connection, None
        if connection is not None:
            try:
                connection.sendall(word)
                connection.close()
            except OSError:
                pass


def _at_exit() -> None:
    # Python sets sys.last_value when it prints an uncaught exception (which names this rank)
    farewell(ANNOUNCED if hasattr(sys, "last_value") else GOODBYE)


def _start_watcher(name: bytes, ranks: list[list[int]]) -> bool:
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(name)
        listener.listen(len(ranks) + 8)
    except OSError:
        return False
    table = ",".join(f"{rank}:{pid}" for rank, pid in ranks)
    try:
        subprocess.Popen(
            [sys.executable, "-m", "pluribus_mpi.deathwatch", str(listener.fileno()), table],
            pass_fds=[listener.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # mpiexec kills each rank's session, not the watcher's
        )
        return True
    except OSError:
        return False
    finally:
        listener.close()


class Mutexes:
    """A process-shared robust pthread mutex at the start of ``shared`` (glibc or musl)."""

    def __init__(self, shared: mmap.mmap):
        self.shared = shared
        self.libc = ctypes.CDLL(None, use_errno=True)  # calls release the GIL
        self.address = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(shared)))

    def init(self) -> None:
        attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t is 4 bytes
        self.libc.pthread_mutexattr_init(attr)
        self.libc.pthread_mutexattr_setpshared(attr, 1)  # PTHREAD_PROCESS_SHARED
        self.libc.pthread_mutexattr_setrobust(attr, 1)  # PTHREAD_MUTEX_ROBUST
        if self.libc.pthread_mutex_init(self.address, attr):
            raise OSError("pthread_mutex_init failed")

    def lock(self) -> int:
        """0, or EOWNERDEAD when the holder died (the lock is then this thread's)."""
        return self.libc.pthread_mutex_lock(self.address)


# -- the watcher process ---------------------------------------------------------------------------


class Rank:
    """What the watcher knows of one connected rank."""

    def __init__(self, conn: socket.socket, rank: int, pid: int):
        self.conn, self.rank, self.pid = conn, rank, pid
        self.said = b""
        self.closed = False
        self.released_at: float | None = None  # when its mutex came back (it was ending)

    @property
    def finished(self) -> bool:
        return GOODBYE in self.said or ANNOUNCED in self.said


def watch(listener: socket.socket, ranks: dict[int, int]) -> None:
    """Accept the ranks (``ranks``: pid -> rank) and report the first that ends without
    ``bye``; return when every rank has gone."""
    host = socket.gethostname()
    poller = select.epoll()
    poller.register(listener.fileno(), select.EPOLLIN)
    waiting = dict(ranks)  # not connected yet
    connected: dict[int, Rank] = {}  # by file descriptor
    seen: list[Rank] = []
    reported, listening = False, True
    while waiting or any(not r.closed for r in seen):
        died = []  # in the order the connections closed
        for fd, _ in poller.poll(CHECK_SECONDS if waiting else -1):
            if fd == listener.fileno():
                rank = _accept(listener, waiting)
                if rank is not None:
                    connected[rank.conn.fileno()] = rank
                    seen.append(rank)
                    poller.register(rank.conn.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
                continue
            rank = connected[fd]
            try:
                data, fds, _, _ = socket.recv_fds(rank.conn, 64, 1)
            except OSError:
                data, fds = b"", []
            for passed in fds:
                _await_release(rank, passed)
            if data:
                rank.said += data
                if ANNOUNCED in rank.said and not died:
                    reported = True  # that rank said why it ends; mpiexec now kills the others
                continue
            poller.unregister(fd)
            rank.conn.close()
            rank.closed = True
            del connected[fd]
            if not rank.finished:
                died.append(rank)
        if died and not reported:
            reported = True
            first = _first_to_die(died, seen)
            after = [r.rank for r in seen if r is not first and r.closed and not r.finished]
            try:
                os.write(2, _report(first, after, host).encode(errors="replace"))
            except OSError:
                pass  # mpiexec stopped reading (the job is over)
        for pid in list(waiting):
            if not _exists(pid):
                del waiting[pid]
        if listening and not waiting:
            poller.unregister(listener.fileno())
            listener.close()
            listening = False


def _accept(listener, waiting: dict[int, int]) -> Rank | None:
    conn, _ = listener.accept()
    pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    if pid not in waiting:
        conn.close()  # not a rank of this host (or one that connected twice)
        return None
    return Rank(conn, waiting.pop(pid), pid)


def _await_release(rank: Rank, fd: int) -> None:
    """A thread that blocks on ``rank``'s mutex (in the memory ``fd``) and notes when the kernel
    hands it back."""
    try:
        mutex = Mutexes(mmap.mmap(fd, SLOT_BYTES))
    except (OSError, ValueError):
        return
    finally:
        os.close(fd)

    def wait() -> None:
        mutex.lock()
        rank.released_at = time.monotonic()

    threading.Thread(target=wait, daemon=True).start()


def _first_to_die(died: list[Rank], seen: list[Rank]) -> Rank:
    """The rank that started ending first among those that did not say goodbye: by when their
    mutexes came back (waiting a moment for the threads that note it), else ``died[0]``."""
    deadline = time.monotonic() + ORDER_SECONDS
    while any(r.released_at is None for r in died) and time.monotonic() < deadline:
        time.sleep(0.005)
    ending = [r for r in seen if r.released_at is not None and not r.finished]
    return min(ending, key=lambda r: r.released_at) if ending else died[0]


def _report(first: Rank, after: list[int], host: str) -> str:
    now = time.time()
    when = time.strftime("%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d} UTC"
    then = f"; rank(s) {after} of this host ended after it" if after else ""
    return (
        f"pluribus-mpi: rank {first.rank} (pid {first.pid} on {host}) ended without finishing "
        f"(killed, crashed, or exited without MPI_Finalize), seen at {when}{then}. mpiexec ends "
        "the other ranks and names a PID that may be another rank's (on several hosts, the "
        "earliest of these reports is the first)\n"
    )


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> None:
    listener = socket.socket(fileno=int(argv[0]))
    ranks = {}
    for entry in argv[1].split(","):
        rank, pid = entry.split(":")
        ranks[int(pid)] = int(rank)
    watch(listener, ranks)


if __name__ == "__main__":
    main(sys.argv[1:])
