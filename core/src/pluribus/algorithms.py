"""Generic collectives over a backend's send/recv: what a backend without native ones gets.

Each function takes a :class:`~pluribus.backend.Backend` and group-local ranks, works in place on
contiguous arrays, and sends only through ``send``, ``recv`` and ``sendrecv``. The choices follow
MPICH and Gloo: ring all-reduce (reduce-scatter then all-gather, bandwidth-optimal; recursive
doubling for small arrays on power-of-two groups), pipelined
binary-tree broadcast, binomial-tree reduce, ring all-gather and reduce-scatter, pairwise
all-to-all, dissemination barrier.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import byte_view, empty_like, finish_average, flat, reduce_into
from .backend import COLLECTIVE_TAG, Backend
from .types import ReduceOp

#: Segment size of the pipelined broadcast: large enough to amortise a message's overhead,
#: small enough that the tree's levels overlap.
BROADCAST_SEGMENT_BYTES = 1 << 20


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Split ``n`` elements into ``parts`` nearly equal chunks: the ``parts + 1`` boundaries."""
    base, extra = divmod(n, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + base + (1 if i < extra else 0))
    return out


#: All-reduces up to this size on a power-of-two group exchange whole arrays by recursive
#: doubling (log2 p messages, each a fixed cost for a small array) instead of the ring's 2(p-1).
DOUBLING_MAX_BYTES = 64 << 10


def all_reduce(b: Backend, array: Any, op: ReduceOp) -> None:
    p, r = b.size, b.rank
    data = flat(array)
    if p > 1 and p & (p - 1) == 0 and data.nbytes <= DOUBLING_MAX_BYTES:
        # Every rank combines the same partial results (in the other order: the ops are
        # commutative), so every rank ends with the same bits, as with the ring.
        incoming = empty_like(data)
        mask = 1
        while mask < p:
            b.sendrecv(data, r ^ mask, incoming, r ^ mask, COLLECTIVE_TAG)
            reduce_into(data, incoming, op)
            mask <<= 1
    elif p > 1:
        bounds = chunk_bounds(data.size, p)
        chunks = [data[bounds[i] : bounds[i + 1]] for i in range(p)]
        right, left = (r + 1) % p, (r - 1) % p
        scratch = empty_like(chunks[0])
        # reduce-scatter: after p-1 steps rank r holds the full reduction of chunk (r + 1) % p
        for step in range(p - 1):
            send_c, recv_c = (r - step) % p, (r - step - 1) % p
            incoming = scratch[: chunks[recv_c].size]
            b.sendrecv(chunks[send_c], right, incoming, left, COLLECTIVE_TAG)
            reduce_into(chunks[recv_c], incoming, op)
        # all-gather the reduced chunks around the ring
        for step in range(p - 1):
            send_c, recv_c = (r + 1 - step) % p, (r - step) % p
            b.sendrecv(chunks[send_c], right, chunks[recv_c], left, COLLECTIVE_TAG)
    finish_average(array, op, p)


def broadcast(b: Backend, array: Any, src: int) -> None:
    p = b.size
    if p == 1:
        return
    v = (b.rank - src) % p  # rank in a tree rooted at src
    parent = None if v == 0 else ((v - 1) // 2 + src) % p
    children = [(c + src) % p for c in (2 * v + 1, 2 * v + 2) if c < p]
    data = byte_view(array)
    segments = range(0, max(data.size, 1), BROADCAST_SEGMENT_BYTES)
    for start in segments:
        seg = data[start : start + BROADCAST_SEGMENT_BYTES]
        if parent is not None:
            b.recv(seg, parent, COLLECTIVE_TAG)
        for child in children:
            b.send(seg, child, COLLECTIVE_TAG)


def reduce(b: Backend, array: Any, dst: int, op: ReduceOp) -> None:
    p = b.size
    v = (b.rank - dst) % p
    acc = array if v == 0 else array.copy()
    incoming = None
    mask = 1
    while mask < p:
        if v & mask:
            b.send(acc, ((v - mask) + dst) % p, COLLECTIVE_TAG)
            return
        if v + mask < p:
            if incoming is None:
                incoming = empty_like(acc)
            b.recv(incoming, ((v + mask) + dst) % p, COLLECTIVE_TAG)
            reduce_into(acc, incoming, op)
        mask <<= 1
    finish_average(array, op, p)


def all_gather(b: Backend, outputs: list[Any], array: Any) -> None:
    p, r = b.size, b.rank
    byte_view(outputs[r])[...] = byte_view(array)
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_c, recv_c = (r - step) % p, (r - step - 1) % p
        b.sendrecv(outputs[send_c], right, outputs[recv_c], left, COLLECTIVE_TAG)


def reduce_scatter(b: Backend, output: Any, inputs: list[Any], op: ReduceOp) -> None:
    p, r = b.size, b.rank
    if p == 1:
        flat(output)[...] = flat(inputs[0])
        finish_average(output, op, 1)
        return
    right, left = (r + 1) % p, (r - 1) % p
    partial = flat(inputs[(r - 1) % p]).copy()
    for step in range(p - 1):
        recv_c = (r - step - 2) % p
        incoming = empty_like(flat(inputs[recv_c]))
        b.sendrecv(partial, right, incoming, left, COLLECTIVE_TAG)
        reduce_into(incoming, flat(inputs[recv_c]), op)
        partial = incoming
    flat(output)[...] = partial
    finish_average(output, op, p)


def all_to_all(b: Backend, outputs: list[Any], inputs: list[Any]) -> None:
    p, r = b.size, b.rank
    byte_view(outputs[r])[...] = byte_view(inputs[r])
    for step in range(1, p):
        dst, src = (r + step) % p, (r - step) % p
        b.sendrecv(inputs[dst], dst, outputs[src], src, COLLECTIVE_TAG)


def gather(b: Backend, array: Any, outputs: list[Any] | None, dst: int) -> None:
    if b.rank != dst:
        b.send(array, dst, COLLECTIVE_TAG)
        return
    assert outputs is not None
    for src in range(b.size):
        if src == dst:
            byte_view(outputs[src])[...] = byte_view(array)
        else:
            b.recv(outputs[src], src, COLLECTIVE_TAG)


def scatter(b: Backend, array: Any, inputs: list[Any] | None, src: int) -> None:
    if b.rank != src:
        b.recv(array, src, COLLECTIVE_TAG)
        return
    assert inputs is not None
    for dst in range(b.size):
        if dst == src:
            byte_view(array)[...] = byte_view(inputs[dst])
        else:
            b.send(inputs[dst], dst, COLLECTIVE_TAG)


def barrier(b: Backend) -> None:
    p, r = b.size, b.rank
    token = np.zeros(1, dtype=np.uint8)
    got = np.zeros(1, dtype=np.uint8)
    distance = 1
    while distance < p:
        b.sendrecv(token, (r + distance) % p, got, (r - distance) % p, COLLECTIVE_TAG)
        distance <<= 1
