"""One shared-memory segment per group whose ranks all share this host, and the flags that
order the ranks' work on it.

Every member owns a *slot* its peers can read, split in two halves used in turn, and a few
control words, each on its own cache line:

- ``stage``: how many phases this rank has published. A phase is "I wrote my part of the current
  half, and read everything the previous phase promised"; a rank publishes by incrementing its
  own counter and waits until every peer's counter has caught up.
- ``announce``: the collective this rank is running (sequence number, kind, dtype, op, count),
  written like a seqlock, so that a peer that runs something else is named at once instead of
  hanging until the timeout. A large all-reduce also says there whether its array lies in a
  symmetric allocation (:mod:`pluribus_gloo.symmetric`), and where.
- ``sleeping``: set while the rank sleeps in the engine's ``poll``; a publisher that sees it
  rings the rank's socket. In the same line, ``sleeps_on``: the peer on whose ``stage`` word
  this rank sleeps (a futex, see :mod:`pluribus_gloo.futex`); that peer wakes the word after it
  publishes. Also in that line, ``gave_up``: written when this rank's engine fails, before it
  closes its sockets: 2 + the rank it blames (1: none). A peer that then sees this rank's
  connection close (and cannot ask the store, when this rank served it) names the rank that
  failed first instead of this one.

A waiting rank first polls the counters (100 µs, yielding the CPU every other poll; when the host
runs more ranks than cores it yields on every poll, so that a peer queued on the same CPU runs),
then sleeps on the futex of a peer that has not published yet, in 2 ms slices between which it
checks for failures, mismatches and closed peer sockets (a dead peer), and after 50 ms hands the
wait to the engine, whose loop also keeps the group's timeout.

Each *round* of a collective starts with a write into one half and a publish, and ends with the
reads of that half; the next round uses the other half. A rank writes into a half only after every
peer has published the first phase of the round in between, which it does only after finishing
its reads of the round before: two halves are enough, and no rank ever waits for "done reading".
(The pipelined all-reduce in :mod:`pluribus_gloo.local` reads one round while it writes the
round after next into the same half, on regions that do not overlap.)

The segment is created by the group's rank 0 and named to the others through the group's store;
rank 0 unlinks it as soon as everyone has mapped it (or failed to), so it never outlives the
processes. A group uses it only when every member mapped it; otherwise it keeps the rings.
"""

from __future__ import annotations

import logging
import mmap
import os
import time

import numpy as np
from pluribus.errors import CollectiveMismatchError

from . import cma, futex, shm, wire
from .engine import Op

log = logging.getLogger("pluribus.gloo")

ARENA_ENV = "PLURIBUS_GLOO_ARENA"
ARENA_BYTES_ENV = "PLURIBUS_GLOO_ARENA_BYTES"
#: Bytes of one half of a rank's slot: the most one rank writes per round.
DEFAULT_HALF_BYTES = 1 << 20
LINE = 64
# the control words of one rank, as indices into the control block seen as uint64
WORDS_PER_RANK = 5 * LINE // 8
STAGE, ANN_SEQ, ANN_CODE, ANN_COUNT, SLEEPING, SLEEPS_ON, GAVE_UP = 0, 8, 16, 24, 32, 33, 34
# beside the announcement: where a large all-reduce's array lies in a symmetric allocation (the
# allocation's number, 0 for none, and the byte offset); see :mod:`pluribus_gloo.symmetric`
ANN_SHARED, ANN_SHARED_AT = 17, 18
#: How long a waiter polls the flags itself before it sleeps on them, yielding the CPU every
#: other poll; when the host has more ranks than cores, ``YIELD_SECONDS`` instead, yielding on
#: every poll.
SPIN_SECONDS = float(os.environ.get("PLURIBUS_GLOO_ARENA_SPIN_US", 100)) / 1e6
YIELD_SECONDS = float(os.environ.get("PLURIBUS_GLOO_ARENA_YIELD_US", 100)) / 1e6
#: How long a waiter sleeps on the flags (woken by the peer it waits for) before it hands the
#: wait to the engine, which also watches the sockets for dead peers; and the slice of one sleep,
#: after which it checks for failures, mismatches and that deadline.
SLEEP_SECONDS = float(os.environ.get("PLURIBUS_GLOO_ARENA_SLEEP_MS", 50)) / 1e3
SLEEP_SLICE = 0.002


def _control_bytes(size: int) -> int:
    return size * WORDS_PER_RANK * 8


class Arena:
    """One rank's view of its group's segment."""

    def __init__(
        self,
        segment: mmap.mmap,
        size: int,
        rank: int,
        half: int,
        engine,
        ranks,
        timeout,
        name="",
        pids: list[int] | None = None,
        crowded: bool | None = None,
    ):
        self.group_name = ""  # for error messages
        #: every member's process id when every member may read the others' memory
        #: (:mod:`pluribus_gloo.cma`), else None
        self.pids = pids
        #: some member's host runs more ranks than cores, so a sync may wait for a context
        #: switch: agreed when the group opens its segment (None: this rank's engine says), as
        #: the algorithms choose by it and every member must choose alike
        self.crowded = engine.yield_while_spinning if crowded is None else crowded
        #: the segment's name (gone from /dev/shm once every member mapped it): unique on this
        #: host, and known to every member, so symmetric allocations derive theirs from it
        self.name = name
        self.segment = segment
        self.timeout = timeout
        self.size = size
        self.rank = rank
        self.half = half
        self.engine = engine
        self.world_ranks = list(ranks)  # group rank -> engine rank
        control = _control_bytes(size)
        self.control = memoryview(segment)[:control].cast("Q")
        base = [r * WORDS_PER_RANK for r in range(size)]
        self.stage_index = [b + STAGE for b in base]
        self.mine = base[rank]
        data = np.frombuffer(segment, dtype=np.uint8, offset=control)
        # halves[h][r]: the uint8 view of rank r's half h
        self.halves = [
            [data[(2 * r + h) * half : (2 * r + h + 1) * half] for r in range(size)] for h in (0, 1)
        ]
        self.typed: dict[np.dtype, list[list[np.ndarray]]] = {}
        self.firsts: dict[np.dtype, list[np.ndarray]] = {}
        self.stage = self.control[self.mine + STAGE]
        self.round = 0
        self.peers = [r for r in range(size) if r != rank]
        crowded = engine.yield_while_spinning  # how this rank waits is its own choice
        self.spin = YIELD_SECONDS if crowded else SPIN_SECONDS
        self.yield_mask = 0 if crowded else 1
        # the futex handles of every rank's counter (its low 32 bits), and the one this rank
        # sleeps on now
        self.futex = futex.Futex(SLEEP_SLICE) if futex.available() else None
        address = np.frombuffer(segment, dtype=np.uint8, count=8).ctypes.data
        self.stage_words = [futex.word(address + 8 * i) for i in self.stage_index]
        self.sleeping_on = None
        self.watched_mark = rank + 1  # what a peer sleeping on our counter writes in SLEEPS_ON
        self.call_seq = 0
        self.call_code = 0
        self.call_count = 0
        self.unchecked = False

    # -- what a collective uses
    def begin(
        self, seq: int, kind: int, dtype: int, opcode: int, count: int, root: int = -1
    ) -> None:
        """Announce the collective this rank now runs (checked by peers while they wait)."""
        c, m = self.control, self.mine
        code = kind | dtype << 8 | opcode << 16 | (root + 1) << 24
        c[m + ANN_SEQ] = 0  # the seqlock: readers skip an announcement being rewritten
        c[m + ANN_CODE] = code
        c[m + ANN_COUNT] = count
        c[m + ANN_SEQ] = seq
        self.call_seq, self.call_code, self.call_count = seq, code, count
        self.unchecked = True

    def announce_shared(self, number: int, offset: int) -> None:
        """Say, before this call's first sync, in which symmetric allocation (0: none) and at
        which byte offset this rank's all-reduce array lies."""
        c, m = self.control, self.mine
        c[m + ANN_SHARED] = number
        c[m + ANN_SHARED_AT] = offset

    def shared_places(self) -> list[tuple[int, int]]:
        """Every rank's :meth:`announce_shared` of this call (read after the first sync)."""
        c = self.control
        return [
            (c[b + ANN_SHARED], c[b + ANN_SHARED_AT])
            for b in range(0, self.size * WORDS_PER_RANK, WORDS_PER_RANK)
        ]

    def next_half(self, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's half for the next round, as whole arrays of ``dtype`` (views made once
        per dtype: slicing a cached view costs less than making one per call)."""
        self.round += 1
        return self.current_half(dtype)

    def current_half(self, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's half of the current round, as whole arrays of ``dtype`` (a second view
        of the round :meth:`next_half` began, such as its header words)."""
        typed = self.typed.get(dtype)
        if typed is None:
            typed = self.typed[dtype] = [[h.view(dtype) for h in pair] for pair in self.halves]
        return typed[self.round & 1]

    def first_elements(self, dtype: np.dtype) -> np.ndarray:
        """Element 0 of every rank's half of the current round, as one ``(size, 1)`` array
        (ranks' halves lie ``2 * half`` bytes apart): a one-element all-reduce reduces it in one
        numpy call, where a call per rank costs 1.4 µs on one-element arrays."""
        firsts = self.firsts.get(dtype)
        if firsts is None:
            stride = (2 * self.half, np.dtype(dtype).itemsize)
            firsts = self.firsts[dtype] = [
                np.lib.stride_tricks.as_strided(pair[0], (self.size, 1), stride)
                for pair in self.typed[dtype]
            ]
        return firsts[self.round & 1]

    def sync(self) -> None:
        """Publish one phase and wait until every peer has published it too."""
        self.stage += 1
        c = self.control
        c[self.mine + STAGE] = self.stage
        engine = self.engine
        watched = False
        for peer in self.peers:
            base = peer * WORDS_PER_RANK
            if c[base + SLEEPING]:
                c[base + SLEEPING] = 0
                engine._ring_doorbell(engine.links[self.world_ranks[peer]])
            if c[base + SLEEPS_ON] == self.watched_mark:
                watched = True
        if watched:
            futex.wake(self.stage_words[self.rank])
        if self._arrived() or self._spin() or self._sleep():
            if self.unchecked:
                self._check_after_arrival()
            return
        op = Op(self._describe, {self.world_ranks[p] for p in self.peers}, True)
        op.pending = 1
        for peer in op.members:
            op.waiting_on[peer] = 1
        op.poll = self._poll
        engine.wait(op, self.timeout, (self.group_name, self.call_seq, self.world_ranks))
        if self.unchecked:
            self._check_after_arrival()

    def _spin(self) -> bool:
        """Poll the flags for up to ``self.spin`` seconds, yielding the CPU every other poll (every
        poll when the host runs more ranks than cores): on a busy host the peer we wait for may
        be queued on this very CPU (measured: a pure spin costs about its whole length per call
        there), on an idle one a yield returns at once."""
        if not self.spin:
            return False
        deadline = time.monotonic() + self.spin
        polls = 0
        mask = self.yield_mask
        while True:
            if self._arrived():
                return True
            polls += 1
            if polls & mask == 0:
                os.sched_yield()
            if time.monotonic() > deadline:
                return False

    def _sleep(self) -> bool:
        """Sleep on the counter of a peer that has not published yet (its next publish wakes us),
        in slices, for up to ``SLEEP_SECONDS``; False when the wait must go on in the engine (a
        failure, a mismatch, a dead peer, or a peer that is this late: the engine raises the
        errors and keeps the timeout)."""
        if self.futex is None:
            return False
        c, target, engine = self.control, self.stage, self.engine
        checked = time.monotonic()
        end = checked + SLEEP_SECONDS
        while True:
            if engine.failed is not None:  # also set before a close unmaps the segment
                return False
            for peer in self.peers:
                index = peer * WORDS_PER_RANK + STAGE
                seen = c[index]
                if seen < target:
                    break
            else:
                return True
            now = time.monotonic()
            if now > end:
                return False
            if now - checked > SLEEP_SLICE:
                checked = now
                if self._peer_gone():
                    return False
            if self.unchecked and self._mismatch() is not None:
                return False
            # only this rank writes its mark, so no publisher can clear one it did not see
            c[self.mine + SLEEPS_ON] = peer + 1
            self.sleeping_on = self.stage_words[peer]
            if c[index] == seen:
                self.futex.wait(self.sleeping_on, seen)
            self.sleeping_on = None
            if engine.failed is not None:
                return False  # a close may have released the segment: touch nothing
            c[self.mine + SLEEPS_ON] = 0

    def _peer_gone(self) -> bool:
        """Read the peers' sockets (a dead peer's closes) between two slices of a sleep: the engine
        then names the dead rank as soon as it would have while waiting itself."""
        engine = self.engine
        engine._check_control()
        return any(engine.links[self.world_ranks[p]].eof for p in self.peers)

    def interrupt(self) -> None:
        """Wake this rank's own sleep (the engine failed or was aborted in another thread)."""
        handle = self.sleeping_on
        if handle is not None:
            futex.wake(handle)

    def _check_after_arrival(self) -> None:
        """Every peer has published the first phase of this call, so each has announced it (or
        moved past it, which it does only after checking ours)."""
        self.unchecked = False
        error = self._mismatch()
        if error is not None:
            self.raise_error(error, "mismatch")

    def raise_error(self, error: Exception, code: str) -> None:
        """Fail the engine with ``error`` (its peers hear of it within milliseconds: their
        sockets close and the store holds the report; ``code`` says what kind of failure) and
        raise it here."""
        engine = self.engine
        with engine.mutex:
            engine._fail(error, code, -1)
        raise error

    # -- waiting
    def _arrived(self) -> bool:
        c, target = self.control, self.stage
        for i in self.stage_index:
            if c[i] < target:
                return False
        return True

    def _poll(self, op: Op) -> bool:
        """Called by the engine's wait loop under its lock: finish ``op`` when every peer has
        published, or fail the engine when a peer announced a different collective."""
        if self._arrived():
            op.pending = 0
            return True
        error = self._mismatch()
        if error is not None:
            self.engine._fail(error, "mismatch", -1)
        return False

    def _mismatch(self) -> CollectiveMismatchError | None:
        """The error to raise when a peer announced another collective under our number."""
        c, seq = self.control, self.call_seq
        for peer in self.peers:
            base = peer * WORDS_PER_RANK
            if c[base + ANN_SEQ] != seq:
                continue
            code, count = c[base + ANN_CODE], c[base + ANN_COUNT]
            if c[base + ANN_SEQ] != seq:
                continue  # rewritten while we read it
            if (code, count) == (self.call_code, self.call_count):
                continue
            theirs = _describe_code(code, count)
            mine = _describe_code(self.call_code, self.call_count)
            return CollectiveMismatchError(
                f"rank {self.rank}: collective mismatch in {self._describe()}: rank {peer} "
                f"called {theirs} as its collective #{seq} while rank {self.rank} called {mine} "
                f"as #{seq}; every rank of a group must call the same collectives in the same "
                "order, with the same dtype, sizes and op"
            )
        return None

    def _describe(self) -> str:
        what = _describe_code(self.call_code, self.call_count)
        return f"{what} (#{self.call_seq}) on group {self.group_name!r}"

    def set_sleeping(self, flag: int) -> None:
        self.control[self.mine + SLEEPING] = flag

    def record_failure(self, blamed: int) -> None:
        """Leave this rank's last word for the peers: it gave up blaming engine rank ``blamed``
        (-1: no rank)."""
        if self.control is not None:
            self.control[self.mine + GAVE_UP] = blamed + 2

    def blamed_by(self, peer: int) -> int | None:
        """The engine rank that member ``peer`` (an engine rank) blamed when it gave up, if it
        did and named one."""
        if self.control is None or peer not in self.world_ranks:
            return None
        value = self.control[self.world_ranks.index(peer) * WORDS_PER_RANK + GAVE_UP]
        return value - 2 if value >= 2 else None

    def close(self) -> None:
        self.control.release()
        self.control = None
        self.halves = None
        self.typed = {}
        self.firsts = {}
        try:
            self.segment.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it


def _describe_code(code: int, count: int) -> str:
    what = wire.describe(code & 0xFF, code >> 8 & 0xFF, code >> 16 & 0xFF, count)
    root = (code >> 24) - 1
    return what if root < 0 else f"{what[:-1]}, root {root})"


def wanted(options: dict) -> bool:
    setting = options.get("arena", os.environ.get(ARENA_ENV, "1"))
    return str(setting).lower() not in ("0", "false", "off", "no")


def half_bytes(options: dict) -> int:
    value = int(options.get("arena_bytes", os.environ.get(ARENA_BYTES_ENV, DEFAULT_HALF_BYTES)))
    return max(4096, value - value % 4096)


def open_arena(engine, ranks: list[int], rank: int, store, timeout: float, options: dict):
    """Agree through the group's store on one segment for the whole group; None when any member
    cannot use one (a peer on another host, shared memory off, a failure to map)."""
    size = len(ranks)
    if size < 2:
        return None
    half = half_bytes(options)
    local = wanted(options) and all(
        r in engine.links and engine.links[r].shm for r in ranks if r != ranks[rank]
    )
    total = _control_bytes(size) + 2 * size * half
    if rank != 0:
        store.set(f"arena/able/{rank}", "1" if local else "0")
        name = store.get("arena/name", timeout).decode()
        segment = shm.map_if_possible(name, total, "the group's shared memory") if name else None
        store.set(f"arena/mapped/{rank}", "1" if segment is not None else "0")
        if name and store.get("arena/verdict", timeout) == b"1":
            pids = cma.agree(store, rank, size, timeout, options)
            crowded = _any_member_crowded(store, rank, size, timeout, engine)
            return Arena(segment, size, rank, half, engine, ranks, timeout, name, pids, crowded)
        if segment is not None:
            segment.close()
        return None
    able = local and all(store.get(f"arena/able/{r}", timeout) == b"1" for r in range(1, size))
    if not able:
        store.set("arena/name", "")
        return None
    shm.sweep_orphans()
    try:
        name, segment = shm.create_mapping(total)
    except OSError as exc:
        log.info("gloo: cannot create the group's shared memory (%s); using the rings", exc)
        store.set("arena/name", "")
        return None
    try:
        store.set("arena/name", name)
        mapped = all(store.get(f"arena/mapped/{r}", timeout) == b"1" for r in range(1, size))
    except BaseException:
        segment.close()
        raise
    finally:
        shm.unlink(name)
    store.set("arena/verdict", "1" if mapped else "0")
    if not mapped:
        segment.close()
        return None
    pids = cma.agree(store, rank, size, timeout, options)
    crowded = _any_member_crowded(store, rank, size, timeout, engine)
    return Arena(segment, size, rank, half, engine, ranks, timeout, name, pids, crowded)


def _any_member_crowded(store, rank: int, size: int, timeout: float, engine) -> bool:
    """Whether any member counts more ranks than cores on this host (each says so for itself
    through the group's store): ranks pinned to different CPU sets count differently."""
    store.set(f"arena/crowded/{rank}", "1" if engine.yield_while_spinning else "0")
    return any(store.get(f"arena/crowded/{r}", timeout) == b"1" for r in range(size))
