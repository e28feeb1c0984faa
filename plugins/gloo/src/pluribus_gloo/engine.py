"""The progress engine: every rank's connections, the messages in flight on them, and the loop
that moves bytes.

Collectives and point-to-point calls *post* sends and receives and then *wait*; waiting drives
the engine, which writes what it can to every peer, reads what has arrived, matches each
incoming message to a posted receive by (group channel, tag) in order, and copies or reduces the
payload straight into the destination array. Nothing blocks on one peer while another has work:
that is what lets a ring step send, receive and reduce at once, and what keeps two ranks that
both send large arrays to each other from deadlocking.

A peer on another host (or with ``PLURIBUS_GLOO_SHM=0``) is reached through a non-blocking TCP
socket. A peer on this host is reached through a pair of shared-memory rings (see
:mod:`pluribus_gloo.shm`); its socket then carries only the goodbye and tells us, by its EOF, that
the peer is gone. While waiting on shared memory the engine polls for a short while (yielding the
CPU), then sleeps in ``poll`` on the sockets with growing timeouts.

One lock guards the engine; the thread holding it makes progress for everyone (collective lane,
point-to-point lanes). Errors that leave the peers out of step (a mismatched collective, a dead
peer in a collective, a timeout) are fatal for the whole engine: it tells the other ranks through
the store, shuts its sockets so they notice at once, and every later call raises the same error.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import threading
import time

import numpy as np
from pluribus import arrival
from pluribus.errors import CollectiveMismatchError, DistTimeoutError, PeerError, PluribusError

from . import wire
from .shm import READER_WAITING, WRITER_WAITING, Ring

SCRATCH_BYTES = 1 << 20
#: Largest piece written to or read from a ring at once: small enough that the peer starts
#: consuming early, large enough to amortise the Python overhead.
SHM_PIECE = int(os.environ.get("PLURIBUS_GLOO_PIECE", 256 << 10))
READ_BUDGET = 8 << 20
#: Messages up to this size go into a ring in one piece with their header.
SMALL_MESSAGE = 4096
SPIN_SECONDS = float(os.environ.get("PLURIBUS_GLOO_SPIN_US", 1000)) / 1e6
#: A sleeper on shared memory is woken by its peer's doorbell; the timeout only bounds the rare
#: race in which both sides miss each other's flag.
MAX_SLEEP_SHM = 0.004
MAX_SLEEP_SOCKET = 0.05
YIELD_MASK = int(os.environ.get("PLURIBUS_GLOO_YIELD_MASK", 1))
_DOORBELL = wire.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, mtype=wire.DOORBELL)

_POLLIN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


#: How many of a group's last collectives a rank remembers for mismatch messages.
RECENT_CALLS = 8


class Op:
    """The requests of one call (a collective or a point-to-point operation)."""

    __slots__ = ("pending", "_what", "members", "collective", "waiting_on", "poll")

    def __init__(self, what, members: set[int], collective: bool):
        self.pending = 0
        # requests not yet finished, per peer: a peer that closed its group cleanly has sent
        # everything, so only a request still waiting on it makes its departure an error
        self.waiting_on: collections.Counter[int] = collections.Counter()
        self._what = what  # a string, or a callable that makes one (only errors need it)
        self.members = members
        self.collective = collective
        # for a wait on shared flags rather than messages: called under the engine lock on every
        # pass of the wait loop, it returns True when it made progress (and sets ``pending``)
        self.poll = None

    @property
    def what(self) -> str:
        return self._what if isinstance(self._what, str) else self._what()


class SendReq:
    __slots__ = ("op", "peer", "header", "payload", "nbytes", "off", "stage", "done")

    def __init__(self, op: Op, header: bytes, payload: np.ndarray):
        self.op = op
        self.peer = -1
        self.header = header
        self.payload = payload
        self.nbytes = payload.size
        self.off = 0
        self.stage = 0  # socket: bytes of header+payload sent; shm: 0 header, 1 payload, 2 pad
        self.done = False


class RecvReq:
    """A posted receive, or (``stash``) an unexpected message kept until one is posted."""

    __slots__ = (
        "op",
        "peer",
        "key",
        "kind",
        "dtype",
        "opcode",
        "seq",
        "count",
        "part",
        "nbytes",
        "check_count",
        "dest",
        "other",
        "ufunc",
        "np_dtype",
        "itemsize",
        "off",
        "done",
        "error",
        "on_done",
        "stash",
        "header",
        "forward",
        "started",
        "root",
    )

    def __init__(self, op: Op | None, key: tuple[int, int], dest: np.ndarray):
        self.op = op
        self.peer = -1
        self.key = key
        self.dest = dest
        self.other = dest
        self.ufunc = None
        self.np_dtype = None
        self.itemsize = 1
        self.off = 0
        self.done = False
        self.error: BaseException | None = None
        self.on_done = None
        self.stash = False
        self.header: wire.Header | None = None
        self.forward: RecvReq | None = None
        self.started = False
        self.check_count = True
        self.root = -1
        self.kind = self.dtype = self.opcode = self.seq = self.count = self.part = 0
        self.nbytes = 0

    def deliver(self, data: np.ndarray) -> None:
        """Copy or reduce the next ``data.size`` payload bytes into the destination."""
        n = data.size
        if self.ufunc is None:
            np.copyto(self.dest[self.off : self.off + n], data)
        else:
            start = self.off // self.itemsize
            stop = start + n // self.itemsize
            self.ufunc(self.other[start:stop], data.view(self.np_dtype), out=self.dest[start:stop])
        self.off += n


class Link:
    """Everything about one peer: socket, optional rings, queues and the incoming message."""

    def __init__(self, peer: int, sock: socket.socket, segment, lower: bool, capacity: int):
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        sock.setblocking(False)
        self.segment = segment
        self.shm = segment is not None
        if self.shm:
            self.out_ring = Ring(segment, 0 if lower else 1, capacity)
            self.in_ring = Ring(segment, 1 if lower else 0, capacity)
        self.sendq: collections.deque[SendReq] = collections.deque()
        self.posted: dict[tuple[int, int], collections.deque[RecvReq]] = {}
        self.unexpected: dict[tuple[int, int], collections.deque[RecvReq]] = {}
        # the incoming message being received: its target (None while discarding) and bytes left
        self.cur: RecvReq | None = None
        self.remaining = 0
        self.in_payload = False
        self.msg_pad = 0
        self.pad_pending = 0
        self.hdr = bytearray(wire.HEADER_SIZE)
        self.hdr_view = memoryview(self.hdr)
        self.hdr_got = 0
        self.scratch: np.ndarray | None = None
        self.fill = 0
        self.eof = False
        self.bye = False
        self.eof_detail = ""
        self.eof_avail = -1
        self.forwarded: BaseException | None = None

    def scratch_buffer(self) -> np.ndarray:
        if self.scratch is None:
            self.scratch = np.empty(SCRATCH_BYTES, dtype=np.uint8)
        return self.scratch


class Engine:
    """One rank's endpoint of the mesh, shared by the world group and its sub-groups."""

    def __init__(self, rank: int, size: int, peers: dict, store, capacity: int):
        self.rank = rank
        self.size = size
        self.store = store
        self.links: dict[int, Link] = {
            peer: Link(peer, conn.sock, conn.segment, rank < peer, capacity)
            for peer, conn in peers.items()
        }
        self.link_list = list(self.links.values())
        self.has_shm = any(link.shm for link in self.link_list)
        self.arenas: list = []  # the shared segments of this rank's all-local groups
        # Spinning ranks must yield the CPU when this host runs more of them than it has cores.
        local_ranks = 1 + sum(1 for link in self.link_list if link.shm)
        self.yield_while_spinning = local_ranks > _cpu_count()
        self.mutex = threading.Lock()
        self.failed: BaseException | None = None
        self.closed = False
        self.waiters = 0
        self.completions = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._last_ctl_check = 0.0
        # per group channel: the collective this rank runs or ran last (seq, kind, root, what)
        self.current: dict[int, tuple] = {}
        # per group channel: the last few collectives' (seq, what), so that a stale message from
        # an earlier call is named against what this rank called at that step
        self.recent: dict[int, collections.deque] = {}
        self.store_down = False  # a store call failed or hung: rank 0 (its server) is gone

    # -- posting ----------------------------------------------------------------------------------
    def post_send(self, op: Op, peer: int, header: bytes, payload: np.ndarray) -> SendReq:
        req = SendReq(op, header, payload)
        req.peer = peer
        op.pending += 1
        op.waiting_on[peer] += 1
        self.links[peer].sendq.append(req)
        return req

    def post_recv(self, op: Op, peer: int, req: RecvReq) -> RecvReq:
        req.peer = peer
        op.pending += 1
        op.waiting_on[peer] += 1
        link = self.links[peer]
        waiting = link.unexpected.get(req.key)
        if waiting:
            stash = waiting.popleft()
            if not self._accept(link, req, stash.header):
                return req  # refused: the stash is dropped, the error is on req or the engine
            req.started = True
            if stash.done:
                self._complete_from_stash(stash, req)
            else:
                stash.forward = req
        else:
            queue = link.posted.get(req.key)
            if queue is None:
                queue = link.posted[req.key] = collections.deque()
            queue.append(req)
        return req

    def cancel(self, req: RecvReq, peer: int) -> bool:
        """Withdraw a posted receive that has not started; False when it has."""
        if req.started or req.done:
            return False
        queue = self.links[peer].posted.get(req.key)
        if queue and req in queue:
            queue.remove(req)
            req.op.pending -= 1
            req.op.waiting_on[peer] -= 1
            return True
        return False

    # -- matching ---------------------------------------------------------------------------------
    def begin(self, channel: int, seq: int, kind: int, root: int, what) -> None:
        """Note the collective this rank starts on a group; messages peers sent for another
        collective at this step, already waiting here, are a mismatch at once."""
        self.current[channel] = (seq, kind, root, what)
        recent = self.recent.get(channel)
        if recent is None:
            recent = self.recent[channel] = collections.deque(maxlen=RECENT_CALLS)
        recent.append((seq, what))
        key = (channel, wire.COLLECTIVE_TAG)
        for link in self.link_list:
            for stash in link.unexpected.get(key, ()):
                if self._stray(link, stash.header):
                    return

    def _stray(self, link: Link, h: wire.Header) -> bool:
        """Fail the engine when ``h`` belongs to no receive this rank will ever post: a message
        for a collective this rank has finished, or a different collective (or root) at the
        step this rank is at. Gloo's collectives post all their receives up front, so such a
        message can only come from a peer that called something else."""
        mine = self.current.get(h.channel)
        if mine is None or h.tag != wire.COLLECTIVE_TAG:
            return False
        seq, kind, root, what = mine
        if h.seq > seq or (h.seq == seq and h.kind == kind and h.root == root):
            return False
        theirs = wire.describe(h.kind, h.dtype, h.op, h.count, root=h.root)
        error = CollectiveMismatchError(
            f"rank {self.rank}: collective mismatch: rank {link.peer} called {theirs} as its "
            f"collective #{h.seq} while rank {self.rank} called "
            f"{self._called(h.channel, h.seq, what())}; every rank of a group must call the same "
            "collectives in the same order, with the same root"
        )
        self._fail(error, "mismatch", -1)
        return True

    def _on_header(self, link: Link, h: wire.Header) -> RecvReq | None:
        """The target of an arriving message: a posted receive, a new stash, or None (discard)."""
        key = (h.channel, h.tag)
        queue = link.posted.get(key)
        if queue:
            req = queue.popleft()
            if not self._accept(link, req, h):
                return None
            req.started = True
            return req
        if self._stray(link, h):
            return None
        stash = RecvReq(None, key, np.empty(h.nbytes, dtype=np.uint8))
        stash.stash = True
        stash.header = h
        waiting = link.unexpected.get(key)
        if waiting is None:
            waiting = link.unexpected[key] = collections.deque()
        waiting.append(stash)
        return stash

    def _accept(self, link: Link, req: RecvReq, h: wire.Header) -> bool:
        """Check an arriving header against the receive it matched; False when refused."""
        peer = link.peer
        if req.kind == wire.SEND:
            if h.kind == wire.SEND and h.nbytes == req.nbytes:
                return True
            sent = wire.describe(h.kind, h.dtype, 0, h.count, h.tag)
            req.error = CollectiveMismatchError(
                f"rank {self.rank}: rank {peer} sent {sent} ({h.nbytes} bytes) but rank "
                f"{self.rank} posted a receive of "
                f"{wire.describe(req.kind, req.dtype, 0, req.count, h.tag)} ({req.nbytes} bytes) "
                f"in {req.op.what}; the sender and receiver must use arrays of the same size"
            )
            req.started = True
            self._finish(req)
            return False
        same_call = (h.kind, h.dtype, h.op, h.seq, h.root) == (
            req.kind,
            req.dtype,
            req.opcode,
            req.seq,
            req.root,
        )
        same_count = h.count == req.count or not req.check_count
        if same_call and same_count and h.part == req.part and h.nbytes == req.nbytes:
            return True
        theirs = wire.describe(h.kind, h.dtype, h.op, h.count, root=h.root)
        mine = wire.describe(req.kind, req.dtype, req.opcode, req.count, root=req.root)
        if same_call and same_count:
            detail = (
                f"rank {peer} sent a block of {h.nbytes} bytes where rank {self.rank} expected "
                f"{req.nbytes} (the ranks passed lists of arrays of different sizes)"
            )
        elif h.seq == req.seq:
            detail = (
                f"rank {peer} called {theirs} as its collective #{h.seq} while rank {self.rank} "
                f"called {mine} as #{req.seq}"
            )
        else:
            detail = (
                f"rank {peer} called {theirs} as its collective #{h.seq} while rank {self.rank} "
                f"called {self._called(h.channel, h.seq, req.op.what)}"
            )
        error = CollectiveMismatchError(
            f"rank {self.rank}: collective mismatch in {req.op.what}: {detail}; every rank of a "
            "group must call the same collectives in the same order, with the same dtype, "
            "sizes and op"
        )
        self._fail(error, "mismatch", -1)
        return False

    def _called(self, channel: int, seq: int, now: str) -> str:
        """What this rank called as collective ``seq`` of ``channel`` and, when that was an
        earlier call (a peer's message for it arrived late), what it runs ``now``."""
        for earlier, what in self.recent.get(channel, ()):
            if earlier == seq:
                said = what()
                return said if said == now else f"{said}, and is now in {now}"
        return f"{now}; its collective #{seq} is too far back to name"

    def _apply_stash(self, stash: RecvReq, req: RecvReq) -> None:
        if req.ufunc is None:
            np.copyto(req.dest[: stash.dest.size], stash.dest)
        else:
            req.ufunc(req.other, stash.dest.view(req.np_dtype), out=req.dest)
        req.off = req.nbytes

    def _complete_from_stash(self, stash: RecvReq, req: RecvReq) -> None:
        self._apply_stash(stash, req)
        self._finish(req)

    def _finish(self, req) -> None:
        req.done = True
        self.completions += 1
        if isinstance(req, SendReq):
            req.op.pending -= 1
            req.op.waiting_on[req.peer] -= 1
            return
        if req.stash:
            if req.forward is not None:
                self._complete_from_stash(req, req.forward)
            return
        req.op.pending -= 1
        req.op.waiting_on[req.peer] -= 1
        if req.on_done is not None and req.error is None:
            req.on_done(req)

    # -- moving bytes -----------------------------------------------------------------------------
    def progress(self) -> bool:
        """One pass over every link; True when any byte moved."""
        moved = False
        for link in self.link_list:
            if link.shm:
                if link.sendq and self._shm_send(link):
                    moved = True
                if self._shm_recv(link):
                    moved = True
            elif not link.eof:
                if link.sendq and self._sock_send(link):
                    moved = True
                if self._sock_recv(link):
                    moved = True
        return moved

    def _shm_send(self, link: Link) -> bool:
        ring = link.out_ring
        moved = False
        while link.sendq:
            req = link.sendq[0]
            if req.stage == 0:
                if req.nbytes <= SMALL_MESSAGE:
                    # header, payload and padding in one copy and one publish
                    whole = req.header + req.payload.tobytes()
                    whole += bytes(-len(whole) % wire.HEADER_SIZE)
                    if ring.space() < len(whole):
                        break
                    ring.write_small(whole)
                    link.sendq.popleft()
                    self._finish(req)
                    moved = True
                    continue
                if ring.space() < wire.HEADER_SIZE:
                    break
                ring.write_small(req.header)
                req.stage = 1
                moved = True
            if req.stage == 1:
                while req.off < req.nbytes:
                    space = ring.space()
                    if space <= 0:
                        break
                    n = min(space, req.nbytes - req.off, SHM_PIECE)
                    ring.write(req.payload[req.off : req.off + n])
                    req.off += n
                    moved = True
                if req.off < req.nbytes:
                    break
                req.stage = 2
            pad = -req.nbytes % wire.HEADER_SIZE
            if pad:
                if ring.space() < pad:
                    break
                ring.advance(pad)
            link.sendq.popleft()
            self._finish(req)
            moved = True
        if moved and ring.control[READER_WAITING]:
            ring.control[READER_WAITING] = 0
            self._ring_doorbell(link)
        return moved

    def _ring_doorbell(self, link: Link) -> None:
        try:
            link.sock.send(_DOORBELL)
        except OSError:
            pass  # a full socket already wakes the peer; a dead one is found elsewhere

    def _shm_recv(self, link: Link) -> bool:
        ring = link.in_ring
        moved = False
        budget = READ_BUDGET
        while budget > 0:
            if link.pad_pending:
                if ring.available() < link.pad_pending:
                    break
                ring.consume(link.pad_pending)
                link.pad_pending = 0
            if not link.in_payload:
                if ring.available() < wire.HEADER_SIZE:
                    break
                h = wire.Header(ring.read_small(wire.HEADER_SIZE))
                ring.consume(wire.HEADER_SIZE)
                moved = True
                target = self._on_header(link, h)
                if h.nbytes == 0:
                    if target is not None:
                        self._finish(target)
                    continue
                link.cur, link.remaining, link.in_payload = target, h.nbytes, True
                link.msg_pad = -h.nbytes % wire.HEADER_SIZE
                continue
            available = ring.available()
            if available <= 0:
                break
            cur = link.cur
            n = min(available, link.remaining, SHM_PIECE)
            view = ring.peek(n)
            n = view.size
            if cur is not None and cur.ufunc is not None:
                n -= n % cur.itemsize
                if n == 0:
                    break
                view = view[:n]
            if cur is not None:
                cur.deliver(view)
            ring.consume(n)
            link.remaining -= n
            budget -= n
            moved = True
            if link.remaining == 0:
                link.in_payload = False
                link.cur = None
                link.pad_pending = link.msg_pad
                if cur is not None:
                    self._finish(cur)
                    if link.sendq:
                        break  # forward what just arrived while it is still in cache
        if moved and ring.control[WRITER_WAITING]:
            ring.control[WRITER_WAITING] = 0
            self._ring_doorbell(link)
        return moved

    def _sock_send(self, link: Link) -> bool:
        sock = link.sock
        moved = False
        while link.sendq:
            req = link.sendq[0]
            try:
                if req.off < wire.HEADER_SIZE:
                    head = memoryview(req.header)[req.off :]
                    if req.nbytes:
                        n = sock.sendmsg([head, req.payload])
                    else:
                        n = sock.send(head)
                else:
                    n = sock.send(req.payload[req.off - wire.HEADER_SIZE :])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._link_eof(link, exc)
                return True
            moved = True
            req.off += n
            if req.off < wire.HEADER_SIZE + req.nbytes:
                break
            link.sendq.popleft()
            self._finish(req)
        return moved

    def _sock_recv(self, link: Link) -> bool:
        sock = link.sock
        moved = False
        budget = READ_BUDGET
        try:
            while budget > 0:
                if not link.in_payload:
                    n = sock.recv_into(link.hdr_view[link.hdr_got :])
                    if n == 0:
                        self._link_eof(link, None)
                        return True
                    moved = True
                    link.hdr_got += n
                    if link.hdr_got < wire.HEADER_SIZE:
                        continue
                    link.hdr_got = 0
                    h = wire.Header(link.hdr)
                    if h.mtype == wire.BYE:
                        link.bye = True
                        continue
                    target = self._on_header(link, h)
                    if h.nbytes == 0:
                        if target is not None:
                            self._finish(target)
                        continue
                    link.cur, link.remaining, link.in_payload = target, h.nbytes, True
                    link.fill = 0
                    continue
                cur = link.cur
                if cur is not None and cur.ufunc is None:
                    n = sock.recv_into(cur.dest[cur.off : cur.off + link.remaining])
                    if n == 0:
                        self._link_eof(link, None)
                        return True
                    cur.off += n
                else:
                    scratch = link.scratch_buffer()
                    want = min(SCRATCH_BYTES - link.fill, link.remaining)
                    n = sock.recv_into(scratch[link.fill : link.fill + want])
                    if n == 0:
                        self._link_eof(link, None)
                        return True
                    if cur is not None:
                        link.fill += n
                        usable = link.fill - link.fill % cur.itemsize
                        if usable:
                            cur.deliver(scratch[:usable])
                            leftover = link.fill - usable
                            if leftover:
                                scratch[:leftover] = scratch[usable : link.fill]
                            link.fill = leftover
                link.remaining -= n
                budget -= n
                moved = True
                if link.remaining == 0:
                    link.in_payload = False
                    link.cur = None
                    if cur is not None:
                        self._finish(cur)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._link_eof(link, exc)
            return True
        return moved

    def _ctl_recv(self, link: Link) -> None:
        """Read the control stream of a shared-memory peer's socket (only BYE travels there)."""
        try:
            while True:
                n = link.sock.recv_into(link.hdr_view[link.hdr_got :])
                if n == 0:
                    self._link_eof(link, None)
                    return
                link.hdr_got += n
                if link.hdr_got == wire.HEADER_SIZE:
                    link.hdr_got = 0
                    if wire.Header(link.hdr).mtype == wire.BYE:
                        link.bye = True
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._link_eof(link, exc)

    # -- peers that go away -----------------------------------------------------------------------
    def _link_eof(self, link: Link, exc: BaseException | None) -> None:
        if link.eof:
            return
        link.eof = True
        if link.bye:
            link.eof_detail = "has closed its process group (destroy_process_group)"
            return
        how = f" ({exc})" if exc is not None else ""
        link.eof_detail = (
            f"closed its connection{how}: the process died, was killed or exited without "
            "destroy_process_group. Restart the job (pluribus-run restarts it when given "
            "--max-restarts)"
        )
        if not self.closed and self.failed is None:
            link.forwarded = self._forwarded_error(link.peer)

    def ask_store(self, question):
        """``question(store)`` within a bound (see :mod:`pluribus.arrival`); None when the store
        does not answer, after which the engine stops asking (rank 0, its server, is gone)."""
        if self.store_down:
            return None
        try:
            return arrival.ask_store(self.store, question)
        except Exception:
            self.store_down = True
            return None

    def _forwarded_error(self, peer: int) -> BaseException | None:
        """The error a peer left in the store before it gave up on the group, if any."""
        key = f"abort/{peer}"
        found = self.ask_store(lambda store: store.get(key, 0.1) if store.check([key]) else None)
        if not found:
            return self._blamed_in_arena(peer)
        code, origin, reporter, text = found.decode(errors="replace").split("|", 3)
        message = (
            f"rank {self.rank}: the group was aborted after an error on rank {reporter}: {text}"
        )
        error: BaseException
        if code == "mismatch":
            error = CollectiveMismatchError(message)
        elif code == "timeout":
            error = DistTimeoutError(message)
        else:
            origin_rank = int(origin)
            error = PeerError(message, origin_rank if origin_rank >= 0 else peer)
        error.gloo_report = (code, origin, reporter, text)  # passed on as is, not re-wrapped
        return error

    def _blamed_in_arena(self, peer: int) -> BaseException | None:
        """When the store has no word from ``peer`` (it may have served the store and exited):
        the rank ``peer`` blamed in its last word on a shared arena, if it left one."""
        for arena in self.arenas:
            blamed = arena.blamed_by(peer)
            if blamed is not None and blamed != self.rank:
                return PeerError(
                    f"rank {self.rank}: rank {peer} gave up on the group because rank {blamed} "
                    f"died or failed, then closed its connection; rank {blamed} is the one to "
                    "look at. Restart the job (pluribus-run restarts it when given "
                    "--max-restarts)",
                    blamed,
                )
        return None

    def _absent(self, position: tuple, timeout: float) -> str:
        """After a timeout: which ranks of the group never reached this collective."""
        group, seq, ranks = position
        missing = None
        if not self.store_down:
            try:
                me = ranks.index(self.rank)
                found = arrival.absent_ranks(self.store, f"reached/{group}/{seq}", me, len(ranks))
                missing = [ranks[r] for r in found]
            except Exception:
                self.store_down = True
        return arrival.explain(missing, timeout)

    def _dead_peer(self, op: Op) -> BaseException | None:
        for peer in op.members:
            link = self.links[peer]
            if not link.eof:
                continue
            if link.bye and op.waiting_on[peer] <= 0:
                continue  # it finished its part of this call before it left
            if link.shm:
                left = link.in_ring.available()
                if left and left != link.eof_avail:
                    link.eof_avail = left  # let the loop drain what it sent before dying
                    continue
            if link.forwarded is not None:
                return link.forwarded
            return PeerError(f"rank {self.rank}: rank {peer} {link.eof_detail}", peer)
        return None

    def _fail(self, error: BaseException, code: str, origin: int) -> None:
        """Give up on the whole engine: tell the peers (through the store and by closing the
        sockets), and make every current and later call raise ``error``."""
        if self.failed is not None:
            return
        self.failed = error
        report = getattr(error, "gloo_report", None)
        if report is None:
            report = (code, str(origin), str(self.rank), str(error))
        for arena in self.arenas:  # read by peers that cannot reach the store (rank 0 serves it)
            arena.record_failure(origin if code == "peer" else -1)
        key, value = f"abort/{self.rank}", "|".join(report)
        self.ask_store(lambda store: store.set(key, value))
        for link in self.link_list:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._wake()
        for arena in self.arenas:  # a call of another thread may sleep on a group's flags
            arena.interrupt()

    def abort(self, reason: str) -> None:
        with self.mutex:
            self._fail(PluribusError(f"rank {self.rank}: aborted: {reason}"), "abort", -1)

    # -- waiting ----------------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _block(self, timeout: float) -> None:
        """Sleep until a socket is ready, another thread wakes us, or ``timeout`` passes."""
        if self.closed:
            return
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for link in self.link_list:
            if link.eof:
                continue
            events = _POLLIN
            if link.sendq and not link.shm:
                events |= select.POLLOUT
            poller.register(link.fd, events)
        try:
            ready = poller.poll(timeout * 1000.0)
        except InterruptedError:
            return
        for fd, _ in ready:
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    pass
        self._check_control()

    def _set_sleeping(self, flag: int) -> None:
        """Raise or lower this rank's "wake me" flags on every shared-memory ring."""
        for link in self.link_list:
            if link.shm and not link.eof:
                link.in_ring.control[READER_WAITING] = flag
                link.out_ring.control[WRITER_WAITING] = flag if link.sendq else 0
        for arena in self.arenas:
            arena.set_sleeping(flag)

    def _check_control(self) -> None:
        with self.mutex:
            if self.closed:
                return
            for link in self.link_list:
                if link.shm and not link.eof:
                    self._ctl_recv(link)
        self._last_ctl_check = time.monotonic()

    def wait(self, op: Op, timeout: float, position: tuple | None = None) -> None:
        """Drive the engine until ``op`` is complete; raise its error, a dead peer's or a
        timeout (after which the engine is unusable when the op was a collective).
        ``position`` (group name, sequence number, the group's ranks) lets a timed-out
        collective name the ranks that never reached it."""
        start = time.monotonic()
        deadline = start + timeout
        idle_since = start
        sleep = 50e-6
        max_sleep = MAX_SLEEP_SHM if self.has_shm else MAX_SLEEP_SOCKET
        spin = SPIN_SECONDS if self.has_shm else 0.0
        if self.yield_while_spinning:
            spin /= 4
        spins = 0
        with self.mutex:
            self.waiters += 1
        try:
            while True:
                with self.mutex:
                    if self.failed is not None:
                        raise _same_error(self.failed)
                    before = self.completions
                    moved = self.progress()
                    if op.poll is not None and op.poll(op):
                        moved = True
                    if self.completions != before and self.waiters > 1:
                        self._wake()
                    if self.failed is not None:
                        raise _same_error(self.failed)
                    if op.pending == 0:
                        return
                    dead = self._dead_peer(op)
                    if dead is not None:
                        if op.collective:
                            origin = dead.peer if isinstance(dead, PeerError) else None
                            code = (
                                "mismatch" if isinstance(dead, CollectiveMismatchError) else "peer"
                            )
                            self._fail(dead, code, -1 if origin is None else origin)
                        raise dead
                now = time.monotonic()
                if moved:
                    idle_since = now
                    sleep = 50e-6
                    continue
                if now >= deadline:
                    absent = "" if position is None else self._absent(position, timeout)
                    error = DistTimeoutError(
                        f"rank {self.rank}: {op.what} did not finish within {timeout:.0f}s"
                        f"{absent or '; a peer may be stuck or may have called something else'}"
                    )
                    if op.collective:
                        with self.mutex:
                            self._fail(error, "timeout", -1)
                    raise error
                if now - idle_since < spin:
                    spins += 1
                    if spins & 255 == 0 and now - self._last_ctl_check > 0.001:
                        self._check_control()
                    elif self.yield_while_spinning or spins & YIELD_MASK == 0:
                        # A peer woken by our doorbell is often placed on this CPU: let it run.
                        os.sched_yield()
                    continue
                if self.has_shm:
                    with self.mutex:
                        if self.failed is not None:
                            continue
                        self._set_sleeping(1)
                        moved = self.progress()  # what arrived while the flags went up
                        if op.poll is not None and op.poll(op):
                            moved = True
                    if not moved:
                        self._block(min(max_sleep, max(0.0, deadline - now)))
                    with self.mutex:
                        if not self.closed:
                            self._set_sleeping(0)
                    idle_since = time.monotonic() - spin  # keep sleeping until something moves
                    if moved:
                        idle_since = time.monotonic()
                    continue
                self._block(min(sleep, max(0.0, deadline - now)))
                sleep = min(sleep * 2, max_sleep)
        finally:
            with self.mutex:
                self.waiters -= 1

    # -- shutting down ----------------------------------------------------------------------------
    def close(self) -> None:
        with self.mutex:
            if self.closed:
                return
            self.closed = True
            was_failed = self.failed is not None
            if not was_failed:  # a call still waiting in another thread stops at once
                self.failed = PluribusError(
                    f"rank {self.rank}: the process group was destroyed while this call waited"
                )
            bye = wire.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, mtype=wire.BYE)
            for link in self.link_list:
                clean = not link.sendq or link.shm
                if not was_failed and not link.eof and clean:
                    try:
                        link.sock.setblocking(True)
                        link.sock.settimeout(1.0)
                        link.sock.sendall(bye)
                    except OSError:
                        pass
                try:
                    link.sock.close()
                except OSError:
                    pass
                if link.shm:
                    link.out_ring.release()
                    link.in_ring.release()
                    link.cur = None
                    try:
                        link.segment.close()
                    except BufferError:
                        pass  # a view is still alive somewhere; the mapping goes with it
            for arena in self.arenas:
                arena.interrupt()
                arena.close()
            self.arenas = []
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _same_error(error: BaseException) -> BaseException:
    """A fresh exception of the same type and message (raising one object twice chains
    tracebacks across calls)."""
    try:
        clone = type(error)(str(error))
    except Exception:
        return error
    if isinstance(error, PeerError):
        clone.peer = error.peer
    return clone
