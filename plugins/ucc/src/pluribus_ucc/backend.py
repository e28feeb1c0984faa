"""The ``ucc`` backend: pluribus collectives over UCX tag-matched messages.

Every collective posts all the non-blocking UCX requests it can at once and waits on them through
the transport's blocking progress, so transfers to and from different peers overlap and a waiting
rank sleeps in epoll. Large all-reduces run a ring (reduce-scatter, then all-gather) cut into
segments: segment ``j`` of a chunk is forwarded to the next rank as soon as it has arrived and been
reduced, while segment ``j + 1`` is still on the wire. cupy arrays are handed to UCX as they are
(UCX's CUDA transports move them device to device) and reduced by cupy on the GPU.
"""

from __future__ import annotations

import functools
import struct
import threading
from typing import Any

from pluribus.algorithms import chunk_bounds
from pluribus.arrays import byte_view, device_of, empty_like, finish_average, flat, reduce_into
from pluribus.arrival import absent_ranks, explain
from pluribus.backend import COLLECTIVE_TAG, Backend
from pluribus.errors import CollectiveMismatchError, DistTimeoutError, PluribusError
from pluribus.types import BackendContext, ReduceOp

from .transport import MAX_TAG, SUBGROUP_SHIFT, Transport

#: Tags of this backend's own collectives: above the core's collective tag, below 2**25 (the
#: core's tag budget).
NATIVE_TAG = COLLECTIVE_TAG + 1
MAX_NATIVE_TAGS = (1 << 24) - 1

#: Pipeline segment of the ring all-reduce and the broadcast tree (bytes).
DEFAULT_SEGMENT_BYTES = 1 << 20
#: The same for cupy arrays: every GPU segment costs a stream synchronisation and a CUDA IPC
#: transfer of its own, so GPU segments are larger.
DEFAULT_CUDA_SEGMENT_BYTES = 16 << 20
#: All-reduces up to this size use recursive doubling (log2(p) exchanges of the whole array)
#: when the group size is a power of two; larger ones the bandwidth-optimal ring.
DEFAULT_SMALL_BYTES = 64 << 10


def _keeps_buffers_on_failure(method, collective: bool = False):
    """On an error, hand every request the call posted to the transport, still in flight or not,
    so that their buffers outlive anything UCX may still write into them.

    A collective that fails on this rank after it posted anything has left its peers out of
    step (they may have received half of it, and its messages would match their next call):
    the transport is aborted, which tells every peer, and every later call fails."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        posted = self._posted.__dict__.setdefault("ops", [])
        mark = len(posted)
        if collective:
            self.seq += 1
        try:
            return method(self, *args, **kwargs)
        except DistTimeoutError as exc:
            self.t.bury(posted[mark:])
            if not collective or self.t.aborted is not None:
                raise
            error = exc
            if not self.t.timed_out_peers:  # this rank timed out first: say who did not arrive
                try:
                    found = absent_ranks(self.store, f"reached/{self.seq}", self.rank, self.size)
                    missing = [self.members[r] for r in found]
                except Exception:
                    missing = None
                where = f"{method.__name__} #{self.seq} of this group"
                error = DistTimeoutError(f"{exc} ({where}){explain(missing, self.timeout)}")
            self.t.abort(str(error), timed_out=True)  # the peers report it as a timeout too
            if error is exc:
                raise
            raise error from None
        except BaseException as exc:
            sent = posted[mark:]
            self.t.bury(sent)
            # only a rank-local error (or a mismatch) aborts: a transport failure is a peer's,
            # which every rank learns through the lifelines; aborting here would name this rank
            # instead of the one that failed
            local = isinstance(exc, CollectiveMismatchError) or not isinstance(exc, PluribusError)
            if collective and sent and local:
                self.t.abort(
                    f"rank {self.t.rank}: {method.__name__} failed after it had started "
                    f"exchanging messages ({type(exc).__name__}: {exc})"
                )
            raise
        finally:
            del posted[mark:]

    return run


def _collective(method):
    return _keeps_buffers_on_failure(method, collective=True)


class UccBackend(Backend):
    """One rank's view of a group: group-local ranks mapped to the transport's world ranks."""

    name = "ucc"
    detects_failures = True  # its own dead-peer detection and timeouts
    devices = ("cpu", "cuda")
    max_tag = MAX_TAG

    def __init__(
        self,
        transport: Transport,
        members: list[int],
        rank: int,
        timeout: float,
        tag_space: int,
        options: dict[str, Any],
        store,
    ):
        super().__init__(rank, len(members), timeout)
        self.t = transport
        self.store = store  # the group's: says who reached a collective that timed out
        self.seq = 0
        self.members = list(members)
        self.tag_base = tag_space << SUBGROUP_SHIFT
        self.options = options
        self.segment_bytes = int(options.get("ucc_segment_bytes", DEFAULT_SEGMENT_BYTES))
        self.cuda_segment_bytes = int(
            options.get("ucc_cuda_segment_bytes", DEFAULT_CUDA_SEGMENT_BYTES)
        )
        self.small_bytes = int(options.get("ucc_small_bytes", DEFAULT_SMALL_BYTES))
        # off by default: it costs more than 5 % at 4 KiB (BENCHMARKS.md); DETAIL checks all
        self.check_calls = _flag(options.get("ucc_check_calls", False))
        self._signed_calls: dict[int, Any] = {}  # step -> this rank's signature at that step
        self.owns_transport = tag_space == 0
        self._posted = threading.local()
        self._buffers: dict[tuple[int, str], Any] = {}

    def __repr__(self) -> str:
        return f"UccBackend(rank={self.rank}, size={self.size}, world_ranks={self.members})"

    # -- plumbing ----------------------------------------------------------------------------------
    def _send(self, array: Any, dst: int, tag: int):
        op = self.t.post_send(array, self.members[dst], self.tag_base + tag)
        self._posted.__dict__.setdefault("ops", []).append(op)
        return op

    def _recv(self, array: Any, src: int, tag: int):
        op = self.t.post_recv(array, self.members[src], self.tag_base + tag)
        self._posted.__dict__.setdefault("ops", []).append(op)
        return op

    def _wait(self, ops, what: str, peers: tuple[int, ...] | None = None) -> None:
        watch = self.members if peers is None else tuple(self.members[p] for p in peers)
        mismatch = CollectiveMismatchError if peers is None else None
        self.t.wait(ops, tuple(watch), what, self.timeout, mismatch)

    def _scratch(self, slot: int, like: Any, count: int) -> Any:
        """``count`` elements like ``like``, from a buffer kept between calls.

        Fresh large allocations are fresh pages: every call would page-fault them in as UCX
        writes, which costs as much as the copy itself. Collectives of one group never overlap,
        so each slot has one user at a time.
        """
        nbytes = count * like.itemsize
        key = (slot, device_of(like))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.nbytes < nbytes:
            if key[1] == "cuda":
                import cupy

                buffer = cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
            else:
                import numpy as np

                buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
            self._buffers[key] = buffer
        return buffer[:nbytes].view(like.dtype)

    @staticmethod
    def _ready(array: Any) -> None:
        """Let the GPU work queued on the current stream finish before UCX touches ``array``.

        UCX reads and writes cupy memory outside that stream, so both hazards are real: a send
        must not read what a kernel has yet to write, and a receive must not land before a
        queued write (``cupy.zeros``, a copy from the host) or a kernel still reading the buffer
        (the reduction of the previous message) is done, or that work overwrites or consumes
        the new data. Called before posting sends and receives on cuda arrays.
        """
        if device_of(array) == "cuda":
            import cupy

            cupy.cuda.get_current_stream().synchronize()

    # -- point to point ----------------------------------------------------------------------------
    @_keeps_buffers_on_failure
    def send(self, array: Any, dst: int, tag: int = 0) -> None:
        self._ready(array)
        self._wait([self._send(array, dst, tag)], f"send to rank {dst} (tag {tag})", (dst,))

    @_keeps_buffers_on_failure
    def recv(self, array: Any, src: int, tag: int = 0) -> None:
        self._ready(array)
        self._wait([self._recv(array, src, tag)], f"recv from rank {src} (tag {tag})", (src,))

    @_keeps_buffers_on_failure
    def sendrecv(self, send_array: Any, dst: int, recv_array: Any, src: int, tag: int = 0) -> None:
        if dst == self.rank and src == self.rank:
            recv_array[...] = send_array
            return
        self._ready(send_array)
        ops = [self._recv(recv_array, src, tag), self._send(send_array, dst, tag)]
        self._wait(ops, f"sendrecv with ranks {dst}/{src}", (dst, src))

    # -- collectives -------------------------------------------------------------------------------
    @_collective
    def all_reduce(self, array: Any, op: ReduceOp) -> None:
        p = self.size
        if p > 1:
            self._ready(array)
            data = flat(array)
            if data.nbytes <= self.small_bytes and p & (p - 1) == 0:
                self._all_reduce_doubling(data, op)
            else:
                self._all_reduce_ring(data, op)
        finish_average(array, op, p)

    def _all_reduce_doubling(self, data: Any, op: ReduceOp) -> None:
        if self.check_calls and device_of(data) == "cpu":
            self._all_reduce_doubling_checked(data, op)
            return
        incoming = self._scratch(0, data, data.size)
        mask, level = 1, 0
        while mask < self.size:
            partner = self.rank ^ mask
            ops = [
                self._recv(incoming, partner, NATIVE_TAG + level),
                self._send(data, partner, NATIVE_TAG + level),
            ]
            self._wait(ops, f"all_reduce (exchange with rank {partner})")
            reduce_into(data, incoming, op)  # a op b == b op a: every rank gets the same bits
            self._ready(data)
            mask, level = mask << 1, level + 1

    def _all_reduce_doubling_checked(self, data: Any, op: ReduceOp) -> None:
        """Recursive doubling whose every message ends with the call's signature (see
        :func:`_signature`): a peer that called another collective, dtype or op is a
        CollectiveMismatchError on this rank (and, through the abort, on every rank)."""
        import numpy as np

        n = data.nbytes
        signature = self._signed("all_reduce", data.dtype, op, -1)
        outgoing = self._scratch(2, np.empty(0, np.uint8), n + SIGNATURE_BYTES)
        incoming = self._scratch(0, np.empty(0, np.uint8), n + SIGNATURE_BYTES)
        outgoing[n:] = signature
        mine = byte_view(data)
        mask, level = 1, 0
        while mask < self.size:
            partner = self.rank ^ mask
            outgoing[:n] = mine
            incoming[n:] = NO_SIGNATURE  # a shorter message must not pass on stale bytes
            ops = [
                self._recv(incoming, partner, NATIVE_TAG + level),
                self._send(outgoing, partner, NATIVE_TAG + level),
            ]
            what = f"all_reduce (exchange with rank {partner})"
            self._wait(ops, what)
            self._check_signature(incoming[n:], signature, partner, what)
            reduce_into(data, incoming[:n].view(data.dtype), op)
            mask, level = mask << 1, level + 1

    def _signed(self, kind: str, dtype: Any, op: ReduceOp | None, root: int):
        """This call's signature (with its number in the group), remembered by that number so
        that a message from an earlier call can be named."""
        signature = _signature(kind, dtype, op, root, self.seq % SIGNED_STEPS)
        self._signed_calls[self.seq % SIGNED_STEPS] = signature
        return signature

    def _check_signature(self, theirs: Any, signature: Any, peer: int, what: str) -> None:
        if theirs.tobytes() == signature.tobytes():
            return
        step = _step(theirs)
        if step is None or step == self.seq % SIGNED_STEPS:
            detail = (
                f"group rank {peer} called {_describe(theirs)} where this rank called "
                f"{_describe(signature)}"
            )
        else:  # a message of an earlier call: that call mismatched and went unnoticed
            number = self.seq - (self.seq - step) % SIGNED_STEPS
            mine = self._signed_calls.get(step)
            here = f"this rank called {_describe(mine)} as #{number}; " if mine is not None else ""
            detail = (
                f"group rank {peer} sent a message of its collective #{number}, "
                f"{_describe(theirs)}, where {here}this rank is at #{self.seq}, "
                f"{_describe(signature)} (the root of a broadcast returns before the others can "
                "tell it of a mismatch, so one shows at a later call)"
            )
        raise CollectiveMismatchError(
            f"rank {self.rank}: collective mismatch in {what}: {detail}; every rank of a group "
            "must call the same collectives in the same order, with the same dtype, op and root"
        )

    def _segments(self, chunk: Any) -> list[Any]:
        size = self.cuda_segment_bytes if device_of(chunk) == "cuda" else self.segment_bytes
        per = max(1, size // max(1, chunk.itemsize))
        return [chunk[i : i + per] for i in range(0, chunk.size, per)]

    def _all_reduce_ring(self, data: Any, op: ReduceOp) -> None:
        p, r = self.size, self.rank
        bounds = chunk_bounds(data.size, p)
        chunks = [data[bounds[i] : bounds[i + 1]] for i in range(p)]
        right, left = (r + 1) % p, (r - 1) % p
        # Step s sends chunk (r - s) and receives chunk (r - s - 1): reduced into place during
        # the reduce-scatter steps (s < p - 1), copied into place during the all-gather steps.
        # What arrives at step s is exactly what leaves at step s + 1, segment by segment.
        steps = 2 * (p - 1)
        scratch = [self._scratch(i, data, chunks[0].size) for i in (0, 1)]
        segs = [self._segments(c) for c in chunks]
        if len(segs[0]) > MAX_NATIVE_TAGS:
            raise ValueError(f"rank {r}: all_reduce needs a larger ucc_segment_bytes option")
        what = "all_reduce"

        def post_recvs(step: int) -> list:
            c = (r - step - 1) % p
            if step < p - 1:
                target = self._segments(scratch[step % 2][: chunks[c].size])
            else:
                target = segs[c]
            return [self._recv(seg, left, NATIVE_TAG + j) for j, seg in enumerate(target)]

        sends = [self._send(seg, right, NATIVE_TAG + j) for j, seg in enumerate(segs[r])]
        recvs = post_recvs(0)
        for step in range(steps):
            following = post_recvs(step + 1) if step + 1 < steps else []
            c = (r - step - 1) % p
            incoming = self._segments(scratch[step % 2][: chunks[c].size])
            for j, request in enumerate(recvs):
                self._wait([request], what)
                if step < p - 1:
                    reduce_into(segs[c][j], incoming[j], op)
                    self._ready(segs[c][j])
                if step + 1 < steps:
                    sends.append(self._send(segs[c][j], right, NATIVE_TAG + j))
            recvs = following
        self._wait(sends, what)

    @_collective
    def broadcast(self, array: Any, src: int) -> None:
        p = self.size
        if p == 1:
            return
        v = (self.rank - src) % p  # position in a binary tree rooted at src
        parent = None if v == 0 else ((v - 1) // 2 + src) % p
        children = [(c + src) % p for c in (2 * v + 1, 2 * v + 2) if c < p]
        if self.check_calls and device_of(array) == "cpu" and array.nbytes <= self.small_bytes:
            self._broadcast_checked(array, src, parent, children)
            return
        segs = self._segments(byte_view(array)) or [byte_view(array)]
        what = f"broadcast from rank {src}"
        sends = []
        self._ready(array)
        if parent is None:
            for j, seg in enumerate(segs):
                sends += [self._send(seg, child, NATIVE_TAG + j) for child in children]
        else:
            recvs = [self._recv(seg, parent, NATIVE_TAG + j) for j, seg in enumerate(segs)]
            for j, request in enumerate(recvs):
                self._wait([request], what)
                sends += [self._send(segs[j], child, NATIVE_TAG + j) for child in children]
        self._wait(sends, what)

    def _broadcast_checked(self, array: Any, src: int, parent, children) -> None:
        """A small broadcast down the tree in one message that ends with the call's signature
        (the root included): a rank whose parent broadcasts from another root, or runs another
        collective, raises CollectiveMismatchError."""
        import numpy as np

        data = byte_view(array)
        n = data.nbytes
        signature = self._signed("broadcast", array.dtype, None, src)
        message = self._scratch(2, np.empty(0, np.uint8), n + SIGNATURE_BYTES)
        what = f"broadcast from rank {src}"
        if parent is None:
            message[:n] = data
            message[n:] = signature
        else:
            message[n:] = NO_SIGNATURE  # a shorter message must not pass on stale bytes
            self._wait([self._recv(message, parent, NATIVE_TAG)], what)
            self._check_signature(message[n:], signature, parent, what)
            data[...] = message[:n]
        self._wait([self._send(message, child, NATIVE_TAG) for child in children], what)

    @_collective
    def all_gather(self, outputs: list, array: Any) -> None:
        p, r = self.size, self.rank
        byte_view(outputs[r])[...] = byte_view(array)
        if p == 1:
            return
        self._ready(outputs[r])
        right, left = (r + 1) % p, (r - 1) % p
        # Every block lands in its final place, so all receives can be posted at once; the block
        # that arrives at step s is forwarded at step s + 1.
        recvs = [self._recv(outputs[(r - s - 1) % p], left, NATIVE_TAG + s) for s in range(p - 1)]
        sends = [self._send(outputs[r], right, NATIVE_TAG)]
        for s, request in enumerate(recvs):
            self._wait([request], "all_gather")
            if s + 1 < p - 1:
                sends.append(self._send(outputs[(r - s - 1) % p], right, NATIVE_TAG + s + 1))
        self._wait(sends, "all_gather")

    @_collective
    def reduce_scatter(self, output: Any, inputs: list, op: ReduceOp) -> None:
        p, r = self.size, self.rank
        if p == 1:
            flat(output)[...] = flat(inputs[0])
            finish_average(output, op, 1)
            return
        right, left = (r + 1) % p, (r - 1) % p
        # Step s sends the partial sum of block (r - s - 1) and receives block (r - s - 2),
        # adds this rank's part and passes it on; after p - 1 steps block r is complete.
        for x in inputs:
            self._ready(x)
        sends = [self._send(flat(inputs[(r - 1) % p]), right, NATIVE_TAG)]
        partial = None
        for s in range(p - 1):
            c = (r - s - 2) % p
            last = s == p - 2
            incoming = flat(output) if last else empty_like(flat(inputs[c]))
            self._wait([self._recv(incoming, left, NATIVE_TAG + s)], "reduce_scatter")
            reduce_into(incoming, flat(inputs[c]), op)
            self._ready(incoming)
            if not last:
                sends.append(self._send(incoming, right, NATIVE_TAG + s + 1))
            partial = incoming  # kept alive until its send completes
        self._wait(sends, "reduce_scatter")
        del partial
        finish_average(output, op, p)

    @_collective
    def all_to_all(self, outputs: list, inputs: list) -> None:
        p, r = self.size, self.rank
        byte_view(outputs[r])[...] = byte_view(inputs[r])
        for x in inputs:
            self._ready(x)
        order = [(r + k) % p for k in range(1, p)]
        ops = [self._recv(outputs[(r - k) % p], (r - k) % p, NATIVE_TAG) for k in range(1, p)]
        ops += [self._send(inputs[dst], dst, NATIVE_TAG) for dst in order]
        self._wait(ops, "all_to_all")

    @_collective
    def gather(self, array: Any, outputs: list | None, dst: int) -> None:
        if self.rank != dst:
            self._ready(array)
            self._wait([self._send(array, dst, NATIVE_TAG)], f"gather to rank {dst}")
            return
        assert outputs is not None
        byte_view(outputs[dst])[...] = byte_view(array)
        self._ready(array)
        ops = [self._recv(outputs[s], s, NATIVE_TAG) for s in range(self.size) if s != dst]
        self._wait(ops, "gather")

    @_collective
    def scatter(self, array: Any, inputs: list | None, src: int) -> None:
        if self.rank != src:
            self._ready(array)
            self._wait([self._recv(array, src, NATIVE_TAG)], f"scatter from rank {src}")
            return
        assert inputs is not None
        byte_view(array)[...] = byte_view(inputs[src])
        for x in inputs:
            self._ready(x)
        ops = [self._send(inputs[d], d, NATIVE_TAG) for d in range(self.size) if d != src]
        self._wait(ops, "scatter")

    @_collective
    def barrier(self) -> None:
        import numpy as np

        p, r = self.size, self.rank
        token, got = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
        distance, level = 1, 0
        while distance < p:
            ops = [
                self._recv(got, (r - distance) % p, NATIVE_TAG + level),
                self._send(token, (r + distance) % p, NATIVE_TAG + level),
            ]
            self._wait(ops, "barrier")
            distance, level = distance << 1, level + 1

    # -- groups and lifetime -----------------------------------------------------------------------
    def new_subgroup(self, ranks: list[int], ctx: BackendContext) -> Backend:
        """A backend for ``ranks`` over the same UCX worker, in a tag space of its own."""
        if ctx.rank == 0:
            space = self.t.next_tag_space()
            ctx.store.set("ucc/tag-space", str(space))
        else:
            space = int(ctx.store.get("ucc/tag-space", ctx.timeout))
        members = [self.members[r] for r in ranks]
        return UccBackend(self.t, members, ctx.rank, ctx.timeout, space, self.options, ctx.store)

    def abort(self, reason: str) -> None:
        self.t.abort(reason)

    def close(self) -> None:
        if self.owns_transport:
            self.t.close()


#: Bytes of the signature a checked call appends to its messages.
SIGNATURE_BYTES = 8
SIGNATURE_FORMAT = "<BBbBi"  # collective, dtype, op, step, root
#: A signature carries the call's number in the group modulo this.
SIGNED_STEPS = 256
_KINDS = ("all_reduce", "broadcast")
#: What a receive buffer's signature slot holds until a message fills it: no call's signature,
#: so a message from another call that is too short to reach the slot is still a mismatch.
NO_SIGNATURE = 0xFF


@functools.lru_cache(maxsize=4096)
def _signature(kind: str, dtype: Any, op: ReduceOp | None, root: int, step: int):
    """What a checked call appends to its messages: collective, dtype, op, root and the call's
    number in the group (modulo :data:`SIGNED_STEPS`), so that a message left over from an
    earlier call (a broadcast whose root did not match) is not taken for this call's."""
    import numpy as np

    name = op.name if op is not None else ""
    raw = struct.pack(
        SIGNATURE_FORMAT,
        _KINDS.index(kind),
        _DTYPES.index(str(dtype)),
        _OPS.index(name),
        step,
        root,
    )
    return np.frombuffer(raw, dtype=np.uint8)


def _step(signature: Any) -> int | None:
    kind, _, _, step, _ = struct.unpack(SIGNATURE_FORMAT, signature.tobytes())
    return None if kind >= len(_KINDS) else step


def _describe(signature: Any) -> str:
    kind, dtype, op, _, root = struct.unpack(SIGNATURE_FORMAT, signature.tobytes())
    if kind >= len(_KINDS) or dtype >= len(_DTYPES) or op >= len(_OPS):
        return "something else"
    parts = [_DTYPES[dtype]]
    if _OPS[op]:
        parts.append(f"op={_OPS[op]}")
    if root >= 0:
        parts.append(f"root={root}")
    return f"{_KINDS[kind]}({', '.join(parts)})"


_DTYPES = tuple(
    "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64 "
    "bfloat16".split()
)
_OPS = ("", *(op.name for op in ReduceOp))


def _flag(value: Any) -> bool:
    return value not in (False, 0, "0", "false", "False", "no")


def create(ctx: BackendContext) -> UccBackend:
    transport = Transport(ctx.rank, ctx.size, ctx.store, ctx.timeout, dict(ctx.options))
    return UccBackend(
        transport, list(range(ctx.size)), ctx.rank, ctx.timeout, 0, dict(ctx.options), ctx.store
    )
