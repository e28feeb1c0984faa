"""Which rank died: one small watcher process per host names the first rank of the host that
ends without saying goodbye.

When a rank dies, mpiexec (MPICH's hydra) kills every other rank within milliseconds and names
one PID, often not the dead rank's; a thread in a surviving rank seldom runs before it is killed
too. The watcher is not a process mpiexec started, and it has a session of its own (mpiexec
kills each rank's session), so it outlives the ranks. The first rank of each host starts it
(``python -m pluribus_mpi.deathwatch``) with a listening Unix socket and the pid of every rank
of the host; every rank connects. A rank that ends normally sends ``bye`` first; one that says
itself why it ends (an uncaught exception, MPI_Abort) sends ``end``, after which the watcher
stays quiet about the ranks mpiexec kills. The first connection that closes without either is
a rank that died: the watcher prints its rank, pid, host and time (to compare hosts) on its
standard error, which mpiexec shows before its own summary, and exits when every rank of its
host has gone. Connections from other processes are refused (the kernel gives their pid, which
is not a rank's). ``PLURIBUS_MPI_DEATHWATCH=0`` turns it off.
"""

from __future__ import annotations

import atexit
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
#: What a rank sends before it ends: normally, or after saying itself why (an uncaught exception,
#: MPI_Abort); after an announced end the watcher stays quiet about the ranks mpiexec then kills.
GOODBYE = b"bye"
ANNOUNCED = b"end"
#: How often the watcher checks that ranks it has not heard from yet still exist.
CHECK_SECONDS = 1.0

_lock = threading.Lock()
_connection: socket.socket | None = None
_started = False


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1").strip().lower() not in (
        "0",
        "false",
        "no",
    )


def join(MPI: Any) -> None:
    """Every rank calls this once the world has started (a collective on COMM_WORLD): the first
    rank of each host starts the watcher, every rank connects to it. Once per process; any
    failure leaves this rank unwatched rather than failing the job."""
    global _started, _connection
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
    if not started[0]:
        return
    try:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(bytes(name))
    except OSError:
        return
    _connection = connection
    atexit.register(_at_exit)


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


# -- the watcher process ---------------------------------------------------------------------------


def watch(listener: socket.socket, ranks: dict[int, int]) -> None:
    """Accept the ranks (``ranks``: pid -> rank) and report the first that ends without
    ``bye``; return when every rank has gone."""
    host = socket.gethostname()
    poller = select.epoll()
    poller.register(listener.fileno(), select.EPOLLIN)
    waiting = dict(ranks)  # not connected yet
    connected: dict[int, tuple[socket.socket, int, int]] = {}  # fd -> (socket, rank, pid)
    reported, listening = False, True
    while waiting or connected:
        ended = []
        for fd, _ in poller.poll(CHECK_SECONDS if waiting else -1):
            if fd == listener.fileno():
                _accept(listener, poller, waiting, connected)
                continue
            conn, rank, pid = connected[fd]
            try:
                said = conn.recv(16)
            except OSError:
                said = b""
            if said.startswith(ANNOUNCED):
                reported = True  # that rank said why it ends; mpiexec now kills the others
            ended.append((rank, pid, said.startswith((GOODBYE, ANNOUNCED))))
            poller.unregister(fd)
            conn.close()
            del connected[fd]
        died = [(rank, pid) for rank, pid, goodbye in ended if not goodbye]
        if died and not reported:
            reported = True
            try:
                os.write(2, _report(died, host).encode(errors="replace"))
            except OSError:
                pass  # mpiexec stopped reading (the job is over)
        for pid in list(waiting):
            if not _exists(pid):
                del waiting[pid]
        if listening and not waiting:
            poller.unregister(listener.fileno())
            listener.close()
            listening = False


def _accept(listener, poller, waiting: dict[int, int], connected: dict) -> None:
    conn, _ = listener.accept()
    pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    if pid not in waiting:
        conn.close()  # not a rank of this host (or one that connected twice)
        return
    connected[conn.fileno()] = (conn, waiting.pop(pid), pid)
    poller.register(conn.fileno(), select.EPOLLIN | select.EPOLLRDHUP)


def _report(died: list[tuple[int, int]], host: str) -> str:
    now = time.time()
    when = time.strftime("%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d} UTC"
    if len(died) == 1:
        rank, pid = died[0]
        who = f"rank {rank} (pid {pid} on {host}) ended"
    else:
        who = (
            f"ranks {[r for r, _ in died]} (pids {[p for _, p in died]} on {host}) ended at once "
            "(one of them first)"
        )
    return (
        f"pluribus-mpi: {who} at {when} without finishing: killed, crashed, or exited without "
        "MPI_Finalize. mpiexec now ends the other ranks; the PID it names may be another "
        "rank's (on several hosts, the earliest of these reports is the first)\n"
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
