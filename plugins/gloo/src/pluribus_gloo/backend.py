"""The gloo backend: native collectives over the progress engine.

Every collective posts all of its receives up front and its first sends, and lets each completed
receive post the send that forwards it (a ring step, a pipeline stage). Large arrays are cut into
pieces so that forwarding starts before a whole block has arrived: on a ring, the reduce of piece
``j`` overlaps with the transfer of piece ``j + 1`` and with the peer's work.

Every message names the collective, dtype, op, element count, sequence number and piece (see
:mod:`pluribus_gloo.wire`); a receiver compares them with what it expects and raises
:class:`~pluribus.errors.CollectiveMismatchError` on every rank when they differ.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
from pluribus.algorithms import chunk_bounds
from pluribus.arrays import byte_view, finish_average, flat, reduce_ufunc
from pluribus.backend import Backend
from pluribus.errors import PluribusError
from pluribus.types import ReduceOp

from . import local, symmetric, wire
from .arena import open_arena
from .engine import Engine, Op, RecvReq, _same_error

#: Pieces of a ring step or pipeline: big enough to amortise per-message work, small enough that
#: forwarding overlaps with receiving.
PIECE_BYTES = int(os.environ.get("PLURIBUS_GLOO_CHUNK", 512 << 10))
#: At or below this size an all-reduce sends the whole array to every peer in one step
#: (one message latency instead of 2 (p - 1)); every rank then reduces in rank order.
DIRECT_ALL_REDUCE_BYTES = int(os.environ.get("PLURIBUS_GLOO_DIRECT_BYTES", 64 << 10))
#: Broadcasts from this size on go down a pipelined chain; smaller ones down a binomial tree.
CHAIN_BROADCAST_BYTES = 256 << 10


def channel_id(group_name: str) -> int:
    """The id every message of a group carries: the same on every member, different per group."""
    return int.from_bytes(hashlib.blake2b(group_name.encode(), digest_size=8).digest(), "little")


def _pieces(lo: int, hi: int, per: int) -> list[tuple[int, int]]:
    if hi <= lo:
        return [(lo, lo)]
    return [(s, min(s + per, hi)) for s in range(lo, hi, per)]


def _lowbit(v: int) -> int:
    return v & -v


class _Call:
    """One collective in flight on one backend: posts its messages, then waits for all."""

    def __init__(
        self,
        backend: GlooBackend,
        kind: int,
        array: Any,
        op: ReduceOp | None,
        count: int,
        check_count: bool = True,
        root: int = -1,
    ):
        self.b = backend
        self.engine = backend.engine
        self.kind = kind
        self.dtype = wire.dtype_code(array.dtype)
        self.np_dtype = array.dtype
        self.opcode = wire.op_code(op)
        self.count = count
        self.check_count = check_count
        self.root = root
        self.seq = backend.next_seq()
        self.op = Op(self.describe, backend.peer_set, True)
        self.ufunc = _reduce_ufunc(op, self.np_dtype) if op is not None else None
        if backend.arena is not None:  # peers waiting on the arena check what we run
            backend.arena.begin(self.seq, kind, self.dtype, self.opcode, count)

    def describe(self) -> str:
        what = wire.describe(self.kind, self.dtype, self.opcode, self.count, root=self.root)
        return f"{what} (#{self.seq}) on group {self.b.group_name!r}"

    def send(self, peer: int, data: np.ndarray, part: int) -> None:
        payload = byte_view(data)
        header = wire.pack(
            self.kind,
            self.dtype,
            self.opcode,
            self.b.channel,
            wire.COLLECTIVE_TAG,
            self.seq,
            self.count,
            part,
            payload.size,
            root=self.root,
        )
        return self.engine.post_send(self.op, self.b.ranks[peer], header, payload)

    def recv(
        self,
        peer: int,
        dest: np.ndarray,
        part: int,
        reduce: bool = False,
        other: np.ndarray | None = None,
        on_done=None,
    ) -> None:
        if reduce:
            req = RecvReq(self.op, (self.b.channel, wire.COLLECTIVE_TAG), dest)
            req.ufunc = self.ufunc
            req.np_dtype = self.np_dtype
            req.itemsize = self.np_dtype.itemsize
            if other is not None:
                req.other = other
        else:
            req = RecvReq(self.op, (self.b.channel, wire.COLLECTIVE_TAG), byte_view(dest))
        req.kind, req.dtype, req.opcode, req.seq = self.kind, self.dtype, self.opcode, self.seq
        req.count, req.check_count, req.part = self.count, self.check_count, part
        req.root = self.root
        req.nbytes = dest.nbytes
        req.on_done = on_done
        self.engine.post_recv(self.op, self.b.ranks[peer], req)

    def run(self, post) -> None:
        """Post under the engine lock (callbacks post from other threads' progress), then wait."""
        engine = self.engine
        with engine.mutex:
            if engine.failed is not None:
                raise _same_error(engine.failed)
            engine.begin(self.b.channel, self.seq, self.kind, self.root, self.describe)
            post()
        engine.wait(self.op, self.b.timeout, (self.b.group_name, self.seq, self.b.ranks))


class GlooBackend(Backend):
    """One rank's gloo endpoint for one group. Sub-groups share the world's engine."""

    name = "gloo"
    detects_failures = True  # its own dead-peer detection and timeouts
    devices = ("cpu",)

    def __init__(
        self,
        engine: Engine,
        ranks: list[int],
        rank: int,
        timeout: float,
        group_name: str,
        owner: bool,
    ):
        super().__init__(rank, len(ranks), timeout)
        self.engine = engine
        self.ranks = list(ranks)  # group rank -> engine (world) rank
        self.group_name = group_name
        self.channel = channel_id(group_name)
        self.peer_set = {r for i, r in enumerate(self.ranks) if i != rank}
        self.owner = owner
        self.seq = 0
        self.uses_shared_memory = any(
            engine.links[r].shm for r in self.peer_set if r in engine.links
        )
        #: the group's shared segment when every member is on this host (see :mod:`.arena`)
        self.arena = None
        #: how many symmetric allocations the group made (:mod:`.symmetric`; the same count on
        #: every member)
        self.symmetric_allocations = 0
        self._last_signature: tuple = (None, None, 0, 0, None)

    def attach_arena(self, store, options: dict) -> None:
        """Agree with the other members on a shared segment; every member calls it."""
        arena = open_arena(self.engine, self.ranks, self.rank, store, self.timeout, options)
        if arena is not None:
            arena.group_name = self.group_name
            self.arena = arena
            self.engine.arenas.append(arena)

    def empty_symmetric(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """With an arena, an array in one segment with every member's (:mod:`.symmetric`)."""
        return symmetric.allocate(self, shape, dtype)

    def _arena_call(
        self, kind: int, dtype: np.dtype, op: ReduceOp | None, count: int, root: int = -1
    ):
        """Announce a collective on the arena; returns the reduction's ufunc."""
        if self.engine.failed is not None:
            raise _same_error(self.engine.failed)
        last = self._last_signature
        if last[0] is not dtype or last[1] is not op:  # identity: hashing an Enum is slow
            ufunc = _reduce_ufunc(op, dtype) if op is not None else None
            last = self._last_signature = (
                dtype,
                op,
                wire.dtype_code(dtype),
                wire.op_code(op),
                ufunc,
            )
        self.seq += 1
        self.arena.begin(self.seq, kind, last[2], last[3], count, root)
        return last[4]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def unsupported(self, dtype: Any, op: ReduceOp) -> str | None:
        return None

    # -- point to point ---------------------------------------------------------------------------
    def _p2p_send(self, op: Op, array: Any, dst: int, tag: int) -> None:
        payload = byte_view(array)
        header = wire.pack(
            wire.SEND,
            wire.dtype_code(array.dtype),
            0,
            self.channel,
            tag,
            0,
            array.size,
            0,
            payload.size,
        )
        self.engine.post_send(op, self.ranks[dst], header, payload)

    def _p2p_recv(self, op: Op, array: Any, src: int, tag: int) -> RecvReq:
        req = RecvReq(op, (self.channel, tag), byte_view(array))
        req.kind, req.dtype, req.count = wire.SEND, wire.dtype_code(array.dtype), array.size
        req.nbytes = array.nbytes
        self.engine.post_recv(op, self.ranks[src], req)
        return req

    def _p2p(self, what: str, peers: set[int], post) -> None:
        engine = self.engine
        op = Op(f"{what} on group {self.group_name!r}", {self.ranks[p] for p in peers}, False)
        with engine.mutex:
            if engine.failed is not None:
                raise _same_error(engine.failed)
            reqs = post(op)
        try:
            engine.wait(op, self.timeout)
        except BaseException:
            with engine.mutex:
                for req, peer in reqs:
                    if not req.done and not engine.cancel(req, self.ranks[peer]):
                        if req.started:  # half a message consumed: the stream is out of step
                            engine._fail(
                                PluribusError(f"rank {engine.rank}: {what} was interrupted"),
                                "abort",
                                -1,
                            )
            raise
        for req, _ in reqs:
            if req.error is not None:
                raise req.error

    def send(self, array: Any, dst: int, tag: int = 0) -> None:
        self._p2p(
            f"send to rank {dst} (tag {tag})",
            {dst},
            lambda op: self._p2p_send(op, array, dst, tag) or [],
        )

    def recv(self, array: Any, src: int, tag: int = 0) -> None:
        self._p2p(
            f"recv from rank {src} (tag {tag})",
            {src},
            lambda op: [(self._p2p_recv(op, array, src, tag), src)],
        )

    def sendrecv(self, send_array: Any, dst: int, recv_array: Any, src: int, tag: int = 0) -> None:
        if dst == self.rank and src == self.rank:
            byte_view(recv_array)[...] = byte_view(send_array)
            return

        def post(op):
            self._p2p_send(op, send_array, dst, tag)
            return [(self._p2p_recv(op, recv_array, src, tag), src)]

        self._p2p(f"sendrecv with ranks {dst}/{src} (tag {tag})", {dst, src}, post)

    # -- collectives ------------------------------------------------------------------------------
    def all_reduce(self, array: Any, op: ReduceOp) -> None:
        p = self.size
        data = flat(array)
        if p > 1 and self.arena is not None:
            ufunc = self._arena_call(wire.ALL_REDUCE, data.dtype, op, data.size)
            local.all_reduce(self.arena, data, ufunc)
        elif p > 1:
            call = _Call(self, wire.ALL_REDUCE, data, op, data.size)
            if data.nbytes <= DIRECT_ALL_REDUCE_BYTES:
                self._all_reduce_direct(call, data)
            else:
                call.run(lambda: self._post_ring_all_reduce(call, data))
        finish_average(array, op, p)

    def all_reduce_into(self, array: Any, output: Any, op: ReduceOp) -> None:
        """On the arena, the copy into the segment is the one the in-place form makes anyway
        and the result lands straight in ``output``; over TCP, a copy then the in-place form."""
        if self.size > 1 and self.arena is not None:
            data = flat(array)
            ufunc = self._arena_call(wire.ALL_REDUCE, data.dtype, op, data.size)
            local.all_reduce(self.arena, data, ufunc, flat(output))
            finish_average(output, op, self.size)
            return
        output[...] = array
        self.all_reduce(output, op)

    def _all_reduce_direct(self, call: _Call, data: np.ndarray) -> None:
        p, r = self.size, self.rank
        incoming = {j: np.empty_like(data) for j in range(p) if j != r}

        def post():
            for j in range(1, p):
                peer = (r + j) % p
                call.send(peer, data, 0)
                call.recv(peer, incoming[peer], 0)

        call.run(post)
        ufunc = call.ufunc
        if p == 2:
            ufunc(data, incoming[1 - r], out=data)
            return
        ordered = [data if j == r else incoming[j] for j in range(p)]
        total = ufunc(ordered[0], ordered[1])
        for j in range(2, p):
            ufunc(total, ordered[j], out=total)
        data[...] = total

    def _post_ring_all_reduce(self, call: _Call, data: np.ndarray) -> None:
        p, r = self.size, self.rank
        right, left = (r + 1) % p, (r - 1) % p
        bounds = chunk_bounds(data.size, p)
        per = max(1, PIECE_BYTES // data.itemsize)
        pieces = [_pieces(bounds[c], bounds[c + 1], per) for c in range(p)]
        width = max(len(x) for x in pieces)
        steps = 2 * (p - 1)

        def forwarder(step: int, j: int, lo: int, hi: int):
            def forward(_req) -> None:
                call.send(right, data[lo:hi], (step + 1) * width + j)

            return forward

        for j, (lo, hi) in enumerate(pieces[r]):
            call.send(right, data[lo:hi], j)
        for step in range(steps):
            reducing = step < p - 1
            chunk = (r - step - 1) % p if reducing else (r - (step - (p - 1))) % p
            last = step == steps - 1
            for j, (lo, hi) in enumerate(pieces[chunk]):
                call.recv(
                    left,
                    data[lo:hi],
                    step * width + j,
                    reduce=reducing,
                    on_done=None if last else forwarder(step, j, lo, hi),
                )

    def broadcast(self, array: Any, src: int) -> None:
        p, r = self.size, self.rank
        if p == 1:
            return
        if self.arena is not None:
            self._arena_call(wire.BROADCAST, array.dtype, None, array.size, src)
            local.broadcast(self.arena, flat(array), src)
            return
        data = byte_view(array)
        call = _Call(self, wire.BROADCAST, array, None, array.size, root=src)
        v = (r - src) % p

        def real(virtual: int) -> int:
            return (virtual + src) % p

        if data.size < CHAIN_BROADCAST_BYTES:
            limit = _lowbit(v) if v else 1 << p.bit_length()
            children = [real(v + m) for m in _powers(limit) if v + m < p]

            def post():
                if v == 0:
                    for child in children:
                        call.send(child, data, 0)
                else:

                    def forward(_req) -> None:
                        for child in children:
                            call.send(child, data, 0)

                    call.recv(real(v - _lowbit(v)), data, 0, on_done=forward if children else None)
        else:
            pieces = _pieces(0, data.size, PIECE_BYTES)
            nxt = real(v + 1) if v + 1 < p else None

            def post():
                if v == 0:
                    for j, (lo, hi) in enumerate(pieces):
                        call.send(nxt, data[lo:hi], j)
                    return
                for j, (lo, hi) in enumerate(pieces):
                    forward = None
                    if nxt is not None:
                        forward = _sender(call, nxt, data[lo:hi], j)
                    call.recv(real(v - 1), data[lo:hi], j, on_done=forward)

        call.run(post)

    def reduce(self, array: Any, dst: int, op: ReduceOp) -> None:
        p, r = self.size, self.rank
        if p == 1:
            finish_average(array, op, 1)
            return
        data = flat(array)
        call = _Call(self, wire.REDUCE, data, op, data.size, root=dst)
        v = (r - dst) % p
        limit = _lowbit(v) if v else 1 << p.bit_length()
        children = [(v + m + dst) % p for m in _powers(limit) if v + m < p]
        parent = None if v == 0 else (v - _lowbit(v) + dst) % p
        per = max(1, PIECE_BYTES // max(1, data.itemsize))
        pieces = _pieces(0, data.size, per)

        if not children:

            def post():
                for j, (lo, hi) in enumerate(pieces):
                    call.send(parent, data[lo:hi], j)

            call.run(post)
            return
        acc = data if v == 0 else data.copy()
        waiting = [len(children)] * len(pieces)

        def arrived(j: int, lo: int, hi: int):
            def done(_req) -> None:
                waiting[j] -= 1
                if waiting[j] == 0 and parent is not None:
                    call.send(parent, acc[lo:hi], j)

            return done

        def post():
            for j, (lo, hi) in enumerate(pieces):
                for child in children:
                    call.recv(child, acc[lo:hi], j, reduce=True, on_done=arrived(j, lo, hi))

        call.run(post)
        if v == 0:
            finish_average(array, op, p)

    def all_gather(self, outputs: list, array: Any) -> None:
        p, r = self.size, self.rank
        outs = [flat(o) for o in outputs]
        src = flat(array)
        if p > 1 and self.arena is not None:
            counts = [o.size for o in outs]
            self._arena_call(wire.ALL_GATHER, src.dtype, None, sum(counts))
            local.all_gather(self.arena, outs, src, counts)  # this rank's output too
            return
        if not np.shares_memory(outs[r], src):
            np.copyto(outs[r], src)
        if p == 1:
            return
        call = _Call(self, wire.ALL_GATHER, src, None, src.size, check_count=False)
        right, left = (r + 1) % p, (r - 1) % p
        per = max(1, PIECE_BYTES // max(1, src.itemsize))
        pieces = [_pieces(0, o.size, per) for o in outs]
        width = max(len(x) for x in pieces)

        def post():
            for j, (lo, hi) in enumerate(pieces[r]):
                call.send(right, src[lo:hi], j)
            for step in range(p - 1):
                block = (r - step - 1) % p
                out = outs[block]
                for j, (lo, hi) in enumerate(pieces[block]):
                    forward = None
                    if step + 1 < p - 1:
                        forward = _sender(call, right, out[lo:hi], (step + 1) * width + j)
                    call.recv(left, out[lo:hi], step * width + j, on_done=forward)

        call.run(post)

    def reduce_scatter(self, output: Any, inputs: list, op: ReduceOp) -> None:
        p, r = self.size, self.rank
        out = flat(output)
        ins = [flat(x) for x in inputs]
        if p == 1:
            if not np.shares_memory(out, ins[0]):
                np.copyto(out, ins[0])
            finish_average(output, op, 1)
            return
        if self.arena is not None:
            counts = [x.size for x in ins]
            ufunc = self._arena_call(wire.REDUCE_SCATTER, out.dtype, op, sum(counts))
            local.reduce_scatter(self.arena, out, ins, ufunc, counts)
            finish_average(output, op, p)
            return
        call = _Call(self, wire.REDUCE_SCATTER, out, op, out.size, check_count=False)
        right, left = (r + 1) % p, (r - 1) % p
        per = max(1, PIECE_BYTES // max(1, out.itemsize))
        pieces = [_pieces(0, x.size, per) for x in ins]
        width = max(len(x) for x in pieces)

        def post():
            first = (r - 1) % p
            for j, (lo, hi) in enumerate(pieces[first]):
                call.send(right, ins[first][lo:hi], j)
            for step in range(p - 1):
                block = (r - step - 2) % p
                last = step == p - 2
                dest = out if last else np.empty_like(ins[block])
                for j, (lo, hi) in enumerate(pieces[block]):
                    forward = None
                    if not last:
                        forward = _sender(call, right, dest[lo:hi], (step + 1) * width + j)
                    call.recv(
                        left,
                        dest[lo:hi],
                        step * width + j,
                        reduce=True,
                        other=ins[block][lo:hi],
                        on_done=forward,
                    )

        call.run(post)
        finish_average(output, op, p)

    def all_to_all(self, outputs: list, inputs: list) -> None:
        p, r = self.size, self.rank
        outs = [flat(o) for o in outputs]
        ins = [flat(x) for x in inputs]
        if p > 1 and self.arena is not None and local.all_to_all_fits(self.arena):
            # sizes differ between ranks: each pair checks its own (local.all_to_all)
            self._arena_call(wire.ALL_TO_ALL, ins[r].dtype, None, 0)
            local.all_to_all(self.arena, outs, ins)
            return
        if not np.shares_memory(outs[r], ins[r]):
            np.copyto(outs[r], ins[r])
        if p == 1:
            return
        call = _Call(
            self, wire.ALL_TO_ALL, ins[r], None, sum(x.size for x in ins), check_count=False
        )

        def post():
            for s in range(1, p):
                dst, src = (r + s) % p, (r - s) % p
                call.send(dst, ins[dst], 0)
                call.recv(src, outs[src], 0)

        call.run(post)

    def gather(self, array: Any, outputs: list | None, dst: int) -> None:
        p, r = self.size, self.rank
        src = flat(array)
        call = _Call(self, wire.GATHER, src, None, src.size, root=dst)
        if r != dst:
            call.run(lambda: call.send(dst, src, 0))
            return
        outs = [flat(o) for o in outputs]
        np.copyto(outs[r], src)

        def post():
            for peer in range(p):
                if peer != r:
                    call.recv(peer, outs[peer], 0)

        if p > 1:
            call.run(post)

    def scatter(self, array: Any, inputs: list | None, src: int) -> None:
        p, r = self.size, self.rank
        dest = flat(array)
        call = _Call(self, wire.SCATTER, dest, None, dest.size, root=src)
        if r != src:
            call.run(lambda: call.recv(src, dest, 0))
            return
        ins = [flat(x) for x in inputs]
        np.copyto(dest, ins[r])

        def post():
            for peer in range(p):
                if peer != r:
                    call.send(peer, ins[peer], 0)

        if p > 1:
            call.run(post)

    def barrier(self) -> None:
        p, r = self.size, self.rank
        if p == 1:
            return
        token = np.zeros(0, dtype=np.uint8)
        if self.arena is not None:
            self._arena_call(wire.BARRIER, token.dtype, None, 0)
            local.barrier(self.arena)
            return
        call = _Call(self, wire.BARRIER, token, None, 0)
        if p <= 16:

            def post():
                for s in range(1, p):
                    call.send((r + s) % p, token, 0)
                    call.recv((r - s) % p, token, 0)

            call.run(post)
            return
        distance, part = 1, 0
        while distance < p:

            def post(distance=distance, part=part):
                call.send((r + distance) % p, token, part)
                call.recv((r - distance) % p, token, part)

            call.run(post)
            distance <<= 1
            part += 1

    # -- groups and lifetime ----------------------------------------------------------------------
    def new_subgroup(self, ranks: list[int], ctx: Any) -> Backend:
        backend = GlooBackend(
            self.engine,
            [self.ranks[i] for i in ranks],
            ctx.rank,
            ctx.timeout,
            ctx.group_name,
            owner=False,
        )
        backend.attach_arena(ctx.store, dict(ctx.options or {}))
        return backend

    def abort(self, reason: str) -> None:
        self.engine.abort(reason)

    def close(self) -> None:
        if self.owner:
            self.engine.close()  # closes every group's arena
        elif self.arena is not None:
            engine, arena = self.engine, self.arena
            self.arena = None
            with engine.mutex:
                if arena in engine.arenas:
                    engine.arenas.remove(arena)
                    arena.close()


_ufuncs: dict = {}


def _reduce_ufunc(op: ReduceOp, dtype: np.dtype):
    key = (op, dtype)
    ufunc = _ufuncs.get(key)
    if ufunc is None:
        ufunc = _ufuncs[key] = reduce_ufunc(op, dtype)
    return ufunc


def _powers(limit: int) -> list[int]:
    """1, 2, 4, ... below ``limit``, largest first (the biggest subtree is served first)."""
    out = []
    m = 1
    while m < limit:
        out.append(m)
        m <<= 1
    return out[::-1]


def _sender(call: _Call, peer: int, data: np.ndarray, part: int):
    def forward(_req) -> None:
        call.send(peer, data, part)

    return forward
