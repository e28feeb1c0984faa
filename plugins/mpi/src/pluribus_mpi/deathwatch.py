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
whose mutex came back first. So a rank goes on only once the watcher waits on its mutex (at
start, mostly the watcher's own start-up). It prints the rank,
pid, host and time on its standard error, which mpiexec shows before its own summary (mpiexec
waits for that pipe to close), and exits when every rank of its host has gone.

On several hosts mpiexec kills the ranks of every other host too, and their watchers would each
blame one of their own ranks. So the watcher of rank 0's host is the hub: the others connect to
it over TCP (with a token the leaders share through MPI) and send it their host's first end, a
death or a rank that said why it ends, with its wall-clock time; the hub waits a moment for
every host's, and prints only the earliest, if it is a death. A watcher that the hub does not
answer prints its own. ``PLURIBUS_MPI_HOST`` names the host ranks are grouped by (tests run two
"hosts" on one machine); ``PLURIBUS_MPI_DEATHWATCH=0`` turns the watchers off.
"""

from __future__ import annotations

import atexit
import ctypes
import hmac
import json
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
from dataclasses import dataclass, field
from typing import Any

ENV = "PLURIBUS_MPI_DEATHWATCH"
#: The host name ranks are grouped by into watchers (default: the machine's).
HOST_ENV = "PLURIBUS_MPI_HOST"
#: What a rank sends: first its mutex's memory, then before it ends normally, or after saying
#: itself why (an uncaught exception, MPI_Abort).
HELD = b"held;"
#: The watcher's answer to ``HELD``: it waits on the rank's mutex now.
WATCHING = b"w"
#: How long a rank waits for that answer (the watcher's start, about 0.25 s on an idle host).
WATCHING_SECONDS = 10.0
GOODBYE = b"bye;"
ANNOUNCED = b"end;"
#: How often the watcher checks that ranks it has not heard from yet still exist.
CHECK_SECONDS = 1.0
#: How long the watcher waits for the mutexes of ranks whose connections closed.
ORDER_SECONDS = 0.3
#: Bytes of a rank's mutex memory (a pthread_mutex_t is 40 or 48 bytes).
SLOT_BYTES = 128
#: Where in that memory a rank that says why it ends writes when (wall clock, a double): the
#: watcher may read its ``end`` only after mpiexec's kills, and the hub compares times.
SAID_AT = struct.Struct("=d")
SAID_OFFSET = 64
EOWNERDEAD = 130
#: How long the hub waits, after the first end it hears of, for the other hosts' first ends
#: (the deaths mpiexec causes come milliseconds after the one that caused them).
GATHER_SECONDS = 1.0
#: How long a watcher waits for the hub to connect or to acknowledge an end.
HUB_SECONDS = 2.0
#: The longest line the hub reads from another watcher.
LINE_BYTES = 4096

_lock = threading.Lock()
_connection: socket.socket | None = None
_mutex: Mutexes | None = None  # this rank's, held for the life of the process
_started = False


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


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
    node, one_machine = _host_comm(MPI, world)
    try:
        ranks = np.zeros(2 * node.Get_size(), np.int64)
        node.Allgather(np.array([world.Get_rank(), os.getpid()], np.int64), ranks)
        name = bytearray(b"\0pluribus-mpi-" + secrets.token_hex(12).encode())
        node.Bcast(name, root=0)
        hub = _link_hosts(MPI, world, node.Get_rank() == 0, one_machine)
        started = np.zeros(1, np.int8)
        if node.Get_rank() == 0:
            started[0] = _start_watcher(bytes(name), ranks.reshape(-1, 2).tolist(), hub)
        node.Bcast(started, root=0)
    finally:
        node.Free()
    if started[0]:
        connect(bytes(name))


def _host_comm(MPI: Any, world: Any) -> tuple[Any, bool]:
    """The ranks of this rank's host (those sharing its memory and its :func:`host_name`), and
    whether the whole job runs on this machine."""
    from .failure import _allgather_text

    shared = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        names = _allgather_text(shared, host_name())
        node = shared.Split(sorted(set(names)).index(host_name()), shared.Get_rank())
        return node, shared.Get_size() == world.Get_size()
    finally:
        shared.Free()


def _link_hosts(
    MPI: Any, world: Any, leader: bool, one_machine: bool
) -> tuple[str, Any, str] | None:
    """What the watcher of this leader (first rank of a host) needs to reach the others:
    ``("hub", listener, token)`` on rank 0's host, ``("leaf", "addr:port", token)`` on the
    others; None on one host, for non-leaders, or when the hub cannot listen (each watcher
    then prints its own host's deaths). Collective on ``world``."""
    from .env import _bcast_strings

    leaders = world.Split(0 if leader else MPI.UNDEFINED, world.Get_rank())
    if leaders == MPI.COMM_NULL:
        return None
    try:
        if leaders.Get_size() == 1:
            return None
        listener, shared = None, None
        if leaders.Get_rank() == 0:
            listener, shared = _hub_listener(one_machine)
        address, port, token = _bcast_strings(leaders, shared)
        if not token:
            return None
        if listener is not None:
            return ("hub", listener, token)
        return ("leaf", f"{address}:{port}", token)
    finally:
        leaders.Free()


def _hub_listener(one_machine: bool) -> tuple[socket.socket | None, tuple[str, str, str]]:
    """The hub's TCP listener, with a fresh token: on loopback when the job runs on one machine,
    else where the other hosts reach this one (as the job's other listeners,
    ``pluribus.tcp_mesh.listen_address``; the host's address when that says loopback)."""
    from pluribus.tcp_mesh import listen_address

    try:
        address = "127.0.0.1" if one_machine else listen_address()
        if address == "127.0.0.1" and not one_machine:
            address = socket.gethostbyname(socket.gethostname())
        listener = socket.create_server((address, 0), backlog=64)
    except Exception:
        return None, ("", "", "")
    return listener, (address, str(listener.getsockname()[1]), secrets.token_hex(16))


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
        # a rank that died before the watcher waited on its mutex could not be told from the
        # ranks mpiexec kills next: go on once it does (the watcher starting is most of it)
        connection.settimeout(WATCHING_SECONDS)
        try:
            connection.recv(len(WATCHING))
        except TimeoutError:
            pass  # a watcher this slow still names the dead, maybe not the first
        connection.settimeout(None)
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
            if word == ANNOUNCED and _mutex is not None:
                SAID_AT.pack_into(_mutex.shared, SAID_OFFSET, time.time())
            try:
                connection.sendall(word)
                connection.close()
            except OSError:
                pass


def _at_exit() -> None:
    # Python sets sys.last_value when it prints an uncaught exception (which names this rank)
    farewell(ANNOUNCED if hasattr(sys, "last_value") else GOODBYE)


def _start_watcher(name: bytes, ranks: list[list[int]], hub: tuple | None) -> bool:
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(name)
        listener.listen(len(ranks) + 8)
    except OSError:
        if hub is not None and hub[0] == "hub":
            hub[1].close()
        return False
    table = ",".join(f"{rank}:{pid}" for rank, pid in ranks)
    command = [sys.executable, "-m", "pluribus_mpi.deathwatch", str(listener.fileno()), table]
    fds = [listener.fileno()]
    if hub is not None and hub[0] == "hub":
        command += ["--hub", str(hub[1].fileno())]
        fds.append(hub[1].fileno())
    elif hub is not None:
        command += ["--to", hub[1]]
    try:
        watcher = subprocess.Popen(
            command,
            pass_fds=fds,
            stdin=subprocess.PIPE,  # the token: never in the command line, which anyone can read
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # mpiexec kills each rank's session, not the watcher's
        )
        watcher.stdin.write((hub[2] if hub is not None else "").encode() + b"\n")
        watcher.stdin.close()
        return True
    except OSError:
        return False
    finally:
        listener.close()
        if hub is not None and hub[0] == "hub":
            hub[1].close()


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
        self.memory: mmap.mmap | None = None  # its mutex and the time it said why it ends

    def said_at(self) -> float:
        """When this rank said why it ends (wall clock), as it wrote it."""
        written = SAID_AT.unpack_from(self.memory, SAID_OFFSET)[0] if self.memory else 0.0
        return written or time.time()

    @property
    def finished(self) -> bool:
        return GOODBYE in self.said or ANNOUNCED in self.said


@dataclass
class End:
    """The first end a watcher saw on its host: a rank that died, or one that said why it ends
    (after which mpiexec kills the rest). ``at`` is wall-clock time, to compare hosts."""

    kind: str  # "died" or "said"
    rank: int
    pid: int
    host: str
    at: float
    after: list[int] = field(default_factory=list)  # ranks of that host that died after it

    def report(self) -> str:
        when = time.strftime("%H:%M:%S", time.gmtime(self.at)) + f".{int(self.at % 1 * 1000):03d}"
        then = f"; rank(s) {self.after} of that host ended after it" if self.after else ""
        return (
            f"pluribus-mpi: rank {self.rank} (pid {self.pid} on {self.host}) ended without "
            f"finishing (killed, crashed, or exited without MPI_Finalize) at {when} UTC{then}. "
            "mpiexec ends the other ranks and names a PID that may be another rank's\n"
        )

    def line(self) -> bytes:
        return json.dumps(self.__dict__).encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> End:
        """An End from another watcher's line: JSON of exactly these fields (ValueError else)."""
        got = json.loads(line)
        kinds = {"kind": str, "rank": int, "pid": int, "host": str, "at": float, "after": list}
        if not isinstance(got, dict) or set(got) != set(kinds):
            raise ValueError("not an end")
        if isinstance(got["at"], int):
            got["at"] = float(got["at"])
        if got["kind"] not in ("died", "said") or not all(
            isinstance(got[k], t) for k, t in kinds.items()
        ):
            raise ValueError("not an end")
        got["after"] = [r for r in got["after"] if isinstance(r, int)]
        return cls(**got)


def _print(text: str) -> None:
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass  # mpiexec stopped reading (the job is over)


class Alone:
    """The only watcher of the job (one host), or one the hub did not answer: prints a death."""

    def first_end(self, end: End) -> None:
        if end.kind == "died":
            _print(end.report())


class Leaf:
    """A watcher of another host than rank 0's: hands its host's first end to the hub, which
    prints the earliest of all hosts'; prints it itself when the hub does not acknowledge it."""

    def __init__(self, address: str, token: str):
        host, port = address.rsplit(":", 1)
        self.conn: socket.socket | None = None
        try:
            self.conn = socket.create_connection((host, int(port)), timeout=HUB_SECONDS)
            self.conn.sendall(token.encode() + b"\n")
        except OSError:
            self.conn = None

    def first_end(self, end: End) -> None:
        if self.conn is not None:
            try:
                self.conn.settimeout(HUB_SECONDS)
                self.conn.sendall(end.line())
                if self.conn.recv(3) == b"ok\n":
                    return
            except OSError:
                pass
        Alone().first_end(end)


class LeafConnection:
    """A connection to the hub: trusted once it has sent the token."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buffer, self.trusted = conn, bytearray(), False
        conn.setblocking(False)


class Hub:
    """The watcher of rank 0's host: gathers every host's first end for
    :data:`GATHER_SECONDS` after the first, then prints the earliest if it is a death."""

    def __init__(self, listener: socket.socket, token: str):
        self.listener, self.token = listener, token.encode()
        listener.setblocking(False)
        self.leaves: dict[int, LeafConnection] = {}
        self.ends: list[End] = []
        self.deadline: float | None = None
        self.decided = False

    def first_end(self, end: End) -> None:
        self.ends.append(end)
        if self.deadline is None:
            self.deadline = time.monotonic() + GATHER_SECONDS

    def pending(self) -> bool:
        return self.deadline is not None and not self.decided

    def wait_limit(self) -> float | None:
        return max(0.0, self.deadline - time.monotonic()) if self.pending() else None

    def owns(self, fd: int) -> bool:
        return fd == self.listener.fileno() or fd in self.leaves

    def readable(self, fd: int, poller: select.epoll) -> None:
        if fd == self.listener.fileno():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.leaves[conn.fileno()] = LeafConnection(conn)
            poller.register(conn.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
            return
        leaf = self.leaves[fd]
        try:
            data = leaf.conn.recv(LINE_BYTES)
        except OSError:
            data = b""
        keep = bool(data)
        leaf.buffer += data
        while keep and b"\n" in leaf.buffer:
            line, _, rest = bytes(leaf.buffer).partition(b"\n")
            leaf.buffer[:] = rest
            keep = self._take(leaf, line)
        if not keep or len(leaf.buffer) > LINE_BYTES:
            poller.unregister(fd)
            leaf.conn.close()
            del self.leaves[fd]

    def _take(self, leaf: LeafConnection, line: bytes) -> bool:
        """Take one line of a leaf: first its token, then ends; False drops the connection."""
        if not leaf.trusted:
            leaf.trusted = hmac.compare_digest(line, self.token)
            return leaf.trusted
        try:
            end = End.parse(line)
        except ValueError:
            return False
        if not self.decided:
            self.first_end(end)
        try:
            leaf.conn.sendall(b"ok\n")
        except OSError:
            return False
        return True

    def decide_if_due(self) -> None:
        if self.pending() and time.monotonic() >= self.deadline:
            self.decided = True
            first = min(self.ends, key=lambda end: end.at)
            if first.kind == "died":
                _print(first.report())


def watch(listener: socket.socket, ranks: dict[int, int], outlet: Any = None) -> None:
    """Accept the ranks (``ranks``: pid -> rank) and hand the first end of this host (a rank
    that ends without ``bye``, or one that says why it ends) to ``outlet`` (:class:`Alone` by
    default, a :class:`Leaf` or the :class:`Hub`); return when every rank has gone and the hub,
    if this is it, has decided."""
    outlet = outlet or Alone()
    hub = outlet if isinstance(outlet, Hub) else None
    host = host_name()
    poller = select.epoll()
    poller.register(listener.fileno(), select.EPOLLIN)
    if hub is not None:
        poller.register(hub.listener.fileno(), select.EPOLLIN)
    waiting = dict(ranks)  # not connected yet
    connected: dict[int, Rank] = {}  # by file descriptor
    seen: list[Rank] = []
    handled, listening = False, True
    while waiting or any(not r.closed for r in seen) or (hub is not None and hub.pending()):
        limit = CHECK_SECONDS if waiting else None
        if hub is not None and hub.pending():
            limit = min(limit or GATHER_SECONDS, hub.wait_limit())
        died = []  # in the order the connections closed
        for fd, _ in poller.poll(-1 if limit is None else limit):
            if hub is not None and hub.owns(fd):
                hub.readable(fd, poller)
                continue
            if listening and fd == listener.fileno():
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
                try:
                    rank.conn.send(WATCHING)
                except OSError:
                    pass  # it is gone: the close comes next
            if data:
                rank.said += data
                if ANNOUNCED in rank.said and not died and not handled:
                    handled = True  # that rank said why it ends; mpiexec now kills the others
                    outlet.first_end(End("said", rank.rank, rank.pid, host, rank.said_at()))
                continue
            poller.unregister(fd)
            rank.conn.close()
            rank.closed = True
            del connected[fd]
            if not rank.finished:
                died.append(rank)
        if died and not handled:
            handled = True
            first = _first_to_die(died, seen)
            after = [r.rank for r in seen if r is not first and r.closed and not r.finished]
            ended = time.time() - (time.monotonic() - (first.released_at or time.monotonic()))
            outlet.first_end(End("died", first.rank, first.pid, host, ended, after))
        if hub is not None:
            hub.decide_if_due()
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
    rank.memory = mutex.shared

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


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> None:
    """``FD TABLE [--hub FD | --to ADDR:PORT]``, the token (if any) on standard input."""
    listener = socket.socket(fileno=int(argv[0]))
    ranks = {}
    for entry in argv[1].split(","):
        rank, pid = entry.split(":")
        ranks[int(pid)] = int(rank)
    outlet: Any = Alone()
    if len(argv) == 4:
        token = sys.stdin.readline().strip()
        if argv[2] == "--hub":
            outlet = Hub(socket.socket(fileno=int(argv[3])), token)
        else:
            outlet = Leaf(argv[3], token)
    watch(listener, ranks, outlet)


if __name__ == "__main__":
    main(sys.argv[1:])
